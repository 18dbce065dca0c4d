"""A forward that runs this stage's layers in one loop per config branch, each path with its own returns.

Kimi-K3's AMD ``KimiLinearModel`` is the form::

    <shared prefix: embed or receive, the model's own id-start_layer capture>
    if self.config.attn_res_block_size is None:
        for layer_idx, layer in enumerate(...):  ...     # plain residual stream
        if not get_pp_group().is_last_rank:
            return IntermediateTensors({...})
        return hidden_states
    <setup>
    for layer_idx, layer in enumerate(...):  ...         # attention-residual stream, its own capture
    if not get_pp_group().is_last_rank:
        return IntermediateTensors({...})
    return hidden_states

(``if``/``else`` with a loop in each block is the same form). Each path through forward runs exactly one
layer loop; each path is planned on its own (``plan_loop`` over the statements that path runs), so each
branch gets its own captures and each branch's returns their pack / ``(hidden, remote + local)``. The
branches share one prelude, put before the first statement holding a branch: ``collect_remote_aux_hidden_states``
once, the aux list, and the id ``start_layer`` capture on the first rank, taken on the stream every
branch starts from. Pure libcst; imports no vLLM."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import libcst as cst
import libcst.matchers as m

from pipespec.codemods.vllm_native_helpers import Helpers, helper_plan
from pipespec.codemods.vllm_native_loop import ClassLookup, Decline, ForwardPlan, Loop, methods, stage_loops
from pipespec.codemods.vllm_native_names import snippet_of
from pipespec.codemods.vllm_native_qualified import UNBOUND, VllmNames
from pipespec.codemods.vllm_native_shape import bound_names, forward_plan, plan_loop, running_loops


@dataclass(frozen=True)
class Branches:
    """One plan per config branch and the prelude they share."""

    plans: tuple[ForwardPlan, ...]
    prelude_at: cst.If  # the top-level statement holding the first branch: the shared prelude goes before it
    start_capture: bool  # capture id start_layer on the first rank in the prelude
    prefix: tuple[cst.BaseStatement, ...]  # forward's statements before prelude_at (every path runs them)

    @property
    def loop(self) -> Loop:  # every branch runs the same module list (checked)
        return self.plans[0].loop

    @property
    def has_rank_check(self) -> bool:
        return self.plans[0].has_rank_check

    def prelude_residual(self) -> str:
        """The residual argument of the first-rank capture: the name sent on where the prefix binds it
        and no branch's layers rebind it before reading it, else ``None``."""
        plan = self.plans[0]
        bound = plan.residual is not None and any(plan.residual in bound_names(s) for s in self.prefix)
        stale = any(p.stale_residual for p in self.plans if not p.own_capture)
        return plan.residual if bound and not stale and plan.residual is not None else "None"


def forward_plans(cls: cst.ClassDef, line_of: Callable[[cst.CSTNode], int],
                  lookup: ClassLookup | None = None, names: VllmNames = UNBOUND) -> ForwardPlan | Branches | Helpers:
    """``forward_plan`` for a forward with one layer loop; ``Branches`` for one loop per config branch
    (see the module docstring); ``Helpers`` for layers run in helper methods (vllm_native_helpers); the
    one-loop ``Decline`` for any other forward with several, or none that runs the layers."""
    fn = methods(cls)["forward"]
    running = running_loops(fn, stage_loops(fn))
    if not running:  # the layers run in helper methods of the class (DeepSeek-V4.1 NVIDIA)
        helpers = helper_plan(cls, line_of, names)
        if helpers is not None:
            return helpers
    paths = _paths(fn, running) if len(running) > 1 else None
    if paths is None:
        return forward_plan(cls, line_of, lookup, names)
    plans = tuple(plan_loop(cls, fn, path, loop, line_of, lookup, names) for loop, path in paths)
    top = list(cst.ensure_type(fn.body, cst.IndentedBlock).body)
    first = min(i for i, s in enumerate(top) for lp in running if any(x is lp for x in m.findall(s, m.For())))
    prelude_at = cst.ensure_type(top[first], cst.If)
    prefix = tuple(top[:first])
    removed = {n for p in plans for n in p.remove}
    # the model's own capture before the branches (not just its `aux = []`), removed by every branch's plan
    had_start = any(s in removed and m.findall(s, m.Call()) for s in prefix)
    own = [p for p in plans if p.own_capture]
    if own and len(own) < len(plans) and not had_start:
        raise Decline("the branches' layer loops disagree about id start_layer: one keeps the model's own capture "
                      "(which takes no id start_layer) and one is given the contract's (which does)", own[0].loop.node)
    return settle(Branches(plans, prelude_at, had_start or len(own) < len(plans), prefix), paths)


def settle(branches: Branches, paths: Sequence[tuple[cst.For, list[cst.BaseStatement]]] | None = None) -> Branches:
    """``Decline`` where the branches cannot share one prelude: they send different names, fill different
    lists or run different module lists, a branch rebinds the stream between the prelude and its loop, or
    (after ``residual_read``) they disagree on whether the residual is part of the stream."""
    plans = branches.plans
    first = plans[0]
    for p in plans[1:]:
        if (p.hidden, p.residual, p.aux, p.loop.layers_attr) != (first.hidden, first.residual, first.aux, first.loop.layers_attr):
            raise Decline(f"the config branches' layer loops differ in what they send or capture (`{first.hidden}`/"
                          f"`{first.residual}` into {first.aux} over self.{first.loop.layers_attr} vs `{p.hidden}`/"
                          f"`{p.residual}` into {p.aux} over self.{p.loop.layers_attr})", p.loop.node)
        if p.start_capture is not None or first.start_capture is not None:
            raise Decline("a config branch keeps the model's own id start_layer capture: the branches share one "
                          "prelude, which takes that id itself", (p if p.start_capture is not None else first).loop.node)
        if p.before_capture is not None or first.before_capture is not None:
            raise Decline("a config branch keeps the model's own capture before each layer: only one loop of that "
                          "form is understood", (p if p.before_capture is not None else first).loop.node)
    if len({p.stale_residual for p in plans if not p.own_capture}) > 1:
        raise Decline("the config branches' layers disagree on whether the residual is part of the stream",
                      plans[1].loop.node)
    for loop, path in paths or ():
        plan = next(p for p in plans if p.loop.node is loop)
        at = next(i for i, s in enumerate(path) if s is loop)
        watched = {plan.hidden} | ({plan.residual} if plan.residual and not plan.own_capture else set())
        for stmt in path[len(branches.prefix):at]:
            if bound_names(stmt) & watched:
                raise Decline(f"`{snippet_of(stmt)}` rebinds `{'/'.join(sorted(bound_names(stmt) & watched))}` between the "
                              "branch's start and its layer loop: the id start_layer capture, shared by the branches, "
                              "would not be the stream that loop starts from", stmt)
    return branches


def with_plans(branches: Branches, plans: Sequence[ForwardPlan]) -> Branches:
    return settle(replace(branches, plans=tuple(plans)))


def _paths(fn: cst.FunctionDef, running: list[cst.For]) -> list[tuple[cst.For, list[cst.BaseStatement]]] | None:
    """Each running loop with the statements forward runs on the path through it, or None where the loops
    are not one per branch: a loop not at forward's top level or directly in a top-level ``if``/``else``
    block, a branch that does not end in ``return`` with code after it, or a path that runs two loops."""
    top = list(cst.ensure_type(fn.body, cst.IndentedBlock).body)
    where: dict[cst.For, tuple[int, list[cst.BaseStatement] | None]] = {}
    for loop in running:
        for i, stmt in enumerate(top):
            if stmt is loop:
                where[loop] = (i, None)
                break
            if isinstance(stmt, cst.If):
                blocks = [stmt.body, *([stmt.orelse.body] if isinstance(stmt.orelse, cst.Else) else [])]
                hit = next((b for b in blocks if isinstance(b, cst.IndentedBlock)
                            and any(x is loop for x in _through_try(b.body))), None)
                if hit is not None:
                    where[loop] = (i, _through_try(hit.body))
                    break
        else:
            return None
    owners = {i for i, _ in where.values()}
    out: list[tuple[cst.For, list[cst.BaseStatement]]] = []
    for loop in running:
        at, block = where[loop]
        path: list[cst.BaseStatement] = []
        for j, stmt in enumerate(top):
            if j == at:
                if block is None:
                    path.append(stmt)
                    continue
                path += block
                if _ends_in_return(block):
                    break
                continue
            if j in owners:  # another branch's `if`: this path is the one where its test is false
                if not isinstance(stmt, cst.If) or j > at or stmt.orelse is not None:
                    return None  # another loop at top level, or a branch this path also runs
                if not _ends_in_return(cst.ensure_type(stmt.body, cst.IndentedBlock).body):
                    return None
                continue
            path.append(stmt)
        if sum(any(x is lp for s in path for x in m.findall(s, m.For())) for lp in running) != 1:
            return None
        out.append((loop, path))
    return out


def _through_try(block: Sequence[cst.BaseStatement]) -> list[cst.BaseStatement]:
    """A block's statements with a plain ``try:``'s body in place of the ``try`` (its handlers only record a
    failure that code after it reports: MiniMax-M3 AMD 0.33 runs its specialized-decode loop in one)."""
    out: list[cst.BaseStatement] = []
    for stmt in block:
        if isinstance(stmt, cst.Try) and stmt.orelse is None and stmt.finalbody is None:
            out += list(cst.ensure_type(stmt.body, cst.IndentedBlock).body)
        else:
            out.append(stmt)
    return out


def _ends_in_return(block: Sequence[cst.BaseStatement]) -> bool:
    last = block[-1] if block else None
    return isinstance(last, cst.SimpleStatementLine) and any(isinstance(s, (cst.Return, cst.Raise)) for s in last.body)


__all__ = ["Branches", "forward_plans", "with_plans"]
