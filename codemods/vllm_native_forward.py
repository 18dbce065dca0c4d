"""The rewrite of one decoder's ``forward`` by its ``ForwardPlan`` (vllm_native_shape): collect the
remote aux states, capture ``start_layer`` on the first rank and ``idx + 1`` after each layer, pack on
non-last ranks, return ``(hidden, remote + local)`` on the last. Generated lines follow vLLM's ruff
format. Imports no vLLM and does not read the plan's source beyond the nodes the plan names."""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from pipespec.codemods.vllm_forward_shape import names_in
from pipespec.codemods.vllm_native_branches import Branches
from pipespec.codemods.vllm_native_helpers import Helpers
from pipespec.codemods.vllm_native_loop import ForwardPlan
from pipespec.codemods.vllm_native_names import REMOVED_MARK, flat_source_of, source_of


class RewriteForward(cst.CSTTransformer):
    """Apply a ``ForwardPlan``: drop the old capture, add the contract's (see the module docstring); or
    ``Branches``: each branch's plan on its loop and returns, the shared prelude before the branches; or
    ``Helpers``: collect before the helpers run the layers, pack and concatenate around the model's list."""

    def __init__(self, plan: ForwardPlan | Branches | Helpers, annotate: bool) -> None:
        self.branches = plan if isinstance(plan, Branches) else None
        self.helpers = plan if isinstance(plan, Helpers) else None
        plans: tuple[ForwardPlan, ...] = plan.plans if isinstance(plan, Branches) else () if isinstance(plan, Helpers) else (plan,)
        # hidden, residual and aux: the same in every branch (vllm_native_branches.settle)
        self.plan = plans[0] if plans else None
        edits: tuple[ForwardPlan | Helpers, ...] = plans or (cst.ensure_type(plan, Helpers),)  # what marks nodes
        self.aux, self.hidden = edits[0].aux, edits[0].hidden
        self.by_loop = {p.loop.node: p for p in plans}
        self.remove = {n for p in edits for n in p.remove}
        self.nonlast = {r for p in edits for r in p.nonlast}
        self.sent_by = {r: p for p in plans for r in p.nonlast}
        self.last = {r for p in edits for r in p.last}
        self.own_kept = all(p.own_capture for p in plans) if plans else True
        used = {self.aux, self.hidden}.union(*(names_in(p.loop.node) for p in plans))
        if isinstance(plan, Helpers):
            used.add(plan.table)
        self.remote = "remote_aux" if "remote_aux" not in used else "remote_aux_hidden_states"
        self.annotate = annotate
        self.depth = 0
        self.blocks = 0  # indented blocks of forward open at the node visited

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        self.depth += 1
        return self.depth == 1

    def leave_FunctionDef(self, original_node: cst.FunctionDef, updated_node: cst.FunctionDef) -> cst.FunctionDef:
        self.depth -= 1
        return updated_node

    def _residual(self, plan: ForwardPlan, bound: bool = True) -> str:
        live = plan.residual is not None and bound and not plan.stale_residual
        return plan.residual if live and plan.residual is not None else "None"

    def _residual_after_layer(self, plan: ForwardPlan) -> str:
        """The residual argument of the capture after a layer: per layer class where they disagree."""
        if plan.residual_arg is not None:  # the model's own, by config
            return plan.residual_arg
        if plan.stale_for is None or plan.residual is None:
            return self._residual(plan)
        layer, stale = plan.stale_for
        classes = stale[0] if len(stale) == 1 else f"({', '.join(stale)})"
        return f"None if isinstance({layer}, {classes}) else {plan.residual}"

    def _zeroed_residual(self, plan: ForwardPlan) -> str | None:
        """What the non-last hand-off sends as ``"residual"`` where a layer returns None for it (MiniCPM:
        ``return hidden_states, None``; Molmo's norm-after layers: ``residual = None``) and vLLM's runners,
        which copy every received value into a tensor buffer, cannot take None. Zeros stand in only where
        the next stage's first layer never reads the residual it is given (it rebinds it first), so it
        treats them exactly as None (``plan.zero_none_residual``, vllm_native_residual.zero_is_none): every
        layer class rebinds it, or, where the classes disagree, the stack is one class chosen once and the
        layer that ran last is one that rebinds it. None where that does not hold, or the file does not
        import torch: the model's own hand-off is kept."""
        r, h = plan.residual, plan.hidden
        if r is None or not self.annotate or not plan.zero_none_residual:
            return None
        if plan.stale_residual:
            return f"torch.zeros_like({h}) if {r} is None else {r}"
        if plan.stale_for is not None:
            layer, stale = plan.stale_for
            classes = stale[0] if len(stale) == 1 else f"({', '.join(stale)})"
            return f"torch.zeros_like({h}) if {r} is None and isinstance({layer}, {classes}) else {r}"
        return None

    def on_leave(self, original_node: cst.CSTNode, updated_node: cst.CSTNode):  # type: ignore[no-untyped-def]
        if original_node in self.remove:  # a placeholder that leave_IndentedBlock drops
            return cst.SimpleStatementLine([cst.Pass()], leading_lines=getattr(original_node, "leading_lines", ()),
                                           trailing_whitespace=cst.TrailingWhitespace(comment=cst.Comment(REMOVED_MARK)))
        h = self.helpers
        if h is not None and (original_node is h.collect_before or original_node is h.drop_start_before):
            return self._around_helpers(original_node, cst.ensure_type(super().on_leave(original_node, updated_node),
                                                                       cst.SimpleStatementLine))
        return super().on_leave(original_node, updated_node)

    def _around_helpers(self, original: cst.CSTNode, stmt: cst.SimpleStatementLine) -> cst.FlattenSentinel[cst.BaseStatement]:
        """collect_remote_aux_hidden_states before the helpers' table is bound; before the list is
        assembled from it, on later ranks, the id start_layer entry a helper keyed by the entering id made."""
        h = self.helpers
        assert h is not None
        out: list[cst.BaseStatement] = []
        if original is h.collect_before:
            out.append(cst.parse_statement(f"{self.remote} = self.collect_remote_aux_hidden_states(intermediate_tensors)\n")
                       .with_changes(leading_lines=stmt.leading_lines))
            stmt = stmt.with_changes(leading_lines=())
        if original is h.drop_start_before:
            out.append(cst.parse_statement(
                "if not get_pp_group().is_first_rank:\n"
                "    # id start_layer is the previous stage's last (its end_layer), captured there\n"
                f"    {h.table}.pop(self.start_layer, None)\n").with_changes(leading_lines=stmt.leading_lines))
            stmt = stmt.with_changes(leading_lines=())
        return cst.FlattenSentinel([*out, stmt])

    def visit_IndentedBlock(self, node: cst.IndentedBlock) -> None:
        self.blocks += 1

    def leave_IndentedBlock(self, original_node: cst.IndentedBlock, updated_node: cst.IndentedBlock) -> cst.IndentedBlock:
        """Drop the old capture's statements; their blank lines and comments go to the next statement."""
        self.blocks -= 1
        removed = m.SimpleStatementLine(trailing_whitespace=m.TrailingWhitespace(comment=m.Comment(REMOVED_MARK)))
        if not any(m.matches(s, removed) for s in updated_node.body):
            return updated_node
        body: list[cst.BaseStatement] = []
        carry: list[cst.EmptyLine] = []
        for new in updated_node.body:
            if m.matches(new, removed):
                comments = [line for line in new.leading_lines if line.comment is not None]
                about_aux = any(word in line.comment.value.lower() for line in comments if line.comment
                                for word in ("aux", "eagle"))  # e.g. "EAGLE3 is not yet compatible with pipeline parallel"
                # a comment about the old capture goes with it, unless the model's own capture stays
                drop = about_aux and not self.own_kept
                carry += [line for line in new.leading_lines if line.comment is None or not drop]
                continue
            if carry:
                lines = [*carry, *new.leading_lines]
                lines = [x for i, x in enumerate(lines) if x.comment or i == 0 or lines[i - 1].comment]
                new = new.with_changes(leading_lines=lines)
                carry = []
            body.append(new)
        return updated_node.with_changes(body=body)

    def leave_For(self, original_node: cst.For, updated_node: cst.For) -> cst.BaseStatement | cst.FlattenSentinel[cst.BaseStatement]:
        p = self.by_loop.get(original_node)
        if p is None:
            return updated_node
        aux = p.aux
        indent = 4 + 4 * (self.blocks + 1)  # the loop body's column (12 for a loop at forward's top level)
        capture = cst.parse_statement(wrapped_call("self._maybe_add_hidden_state", [
            aux, flat_source_of(p.loop.next_id), p.hidden, self._residual_after_layer(p)], indent=indent))
        body = cst.ensure_type(updated_node.body, cst.IndentedBlock)
        if p.before_capture is not None and p.end_capture is not None:  # the model's own capture before each layer
            prelude = [
                cst.parse_statement(f"{self.remote} = self.collect_remote_aux_hidden_states(intermediate_tensors)\n")
                .with_changes(leading_lines=original_node.leading_lines or [cst.EmptyLine(indent=False)]),
                cst.parse_statement(f"{aux}{': list[torch.Tensor]' if self.annotate else ''} = []\n"),
            ]
            # the stage's last id, captured on every rank before the hand-off, computed as the model's
            # own capture before a layer does (e.g. gathering sequence-parallel shards)
            end = _none_safe(p.before_capture, p.hidden, p.residual).with_changes(test=p.end_capture.test, leading_lines=[
                cst.EmptyLine(indent=True, comment=cst.Comment("# the last id of this stage, on every rank")),
            ])
            return cst.FlattenSentinel([*prelude, updated_node.with_changes(leading_lines=()), end])
        if p.own_capture and self.branches is not None:  # the shared prelude is before the branches
            return updated_node
        if p.own_capture:  # the model's own after-layer capture stays; collect before the loop, nothing else
            prelude = [
                cst.parse_statement(f"{self.remote} = self.collect_remote_aux_hidden_states(intermediate_tensors)\n")
                .with_changes(leading_lines=original_node.leading_lines or [cst.EmptyLine(indent=False)]),
                cst.parse_statement(f"{aux}{': list[torch.Tensor]' if self.annotate else ''} = []\n"),
            ]
            return cst.FlattenSentinel([*prelude, updated_node.with_changes(leading_lines=())])
        new_iter = p.loop.new_iter
        if new_iter is not None and len(source_of(updated_node.target if p.loop.new_target is None else p.loop.new_target)
                                        + source_of(new_iter)) + 4 * self.blocks + 16 > LINE:  # vLLM's own multi-line form
            inner = source_of(cst.ensure_type(new_iter, cst.Call).args[0].value)
            header = cst.ensure_type(cst.parse_statement(
                f"for _ in enumerate(\n    {inner},\n    start=self.start_layer,\n):\n    pass\n"), cst.For)
            new_iter = header.iter
        loop = updated_node.with_changes(iter=new_iter or updated_node.iter,
                                         target=p.loop.new_target or updated_node.target,
                                         body=body.with_changes(body=[*body.body, capture]))
        if self.branches is not None:  # the shared prelude is before the branches
            return loop
        if p.start_capture is not None:  # the prelude goes before the model's own id start_layer capture
            return loop
        prelude = self._prelude(original_node, self._residual(p, p.residual_bound_before_loop), True)
        return cst.FlattenSentinel([*prelude, loop.with_changes(leading_lines=())])

    def _prelude(self, before: cst.BaseCompoundStatement, residual: str, first_rank: bool) -> list[cst.BaseStatement]:
        """collect_remote_aux_hidden_states, the aux list and (``first_rank``) the first rank's id start_layer,
        put before ``before`` with its leading lines."""
        annotation = ": list[torch.Tensor]" if self.annotate else ""
        call = wrapped_call("self._maybe_add_hidden_state", [self.aux, "self.start_layer", self.hidden, residual], indent=12)
        first = cst.parse_statement("if get_pp_group().is_first_rank:\n" + "".join(f"    {line}\n" for line in call.splitlines()))
        return [
            cst.parse_statement(f"{self.remote} = self.collect_remote_aux_hidden_states(intermediate_tensors)\n")
            .with_changes(leading_lines=before.leading_lines or [cst.EmptyLine(indent=False)]),
            cst.parse_statement(f"{self.aux}{annotation} = []\n").with_changes(leading_lines=[cst.EmptyLine(indent=False)]),
            *([first] if first_rank else []),
        ]

    def leave_If(self, original_node: cst.If, updated_node: cst.If) -> cst.If | cst.FlattenSentinel[cst.BaseStatement]:
        if self.branches is not None and original_node is self.branches.prelude_at:
            b = self.branches
            prelude = self._prelude(original_node, b.prelude_residual(), b.start_capture)
            return cst.FlattenSentinel([*prelude, updated_node.with_changes(
                leading_lines=updated_node.leading_lines or [cst.EmptyLine(indent=False)])])
        if self.plan is not None and original_node is self.plan.gather:  # each captured state gathered too
            return cst.FlattenSentinel([updated_node, self._gather_captures(updated_node)])
        if self.plan is not None and original_node is self.plan.start_capture:
            test = f"get_pp_group().is_first_rank and {flat_source_of(updated_node.test)}"  # id start_layer: the first rank's
            if 4 + 4 * self.blocks + len(f"if {test}:") > LINE:  # vLLM's multi-line form
                test = f"(\n    get_pp_group().is_first_rank\n    and {flat_source_of(updated_node.test)}\n)"
            header = cst.ensure_type(cst.parse_statement(f"if {test}:\n    pass\n"), cst.If)
            guarded = updated_node.with_changes(test=header.test, whitespace_before_test=header.whitespace_before_test)
            return cst.FlattenSentinel([*self._prelude(original_node, "None", False), guarded])
        if self.plan is None or original_node is not self.plan.before_capture:
            return updated_node
        idx = self.plan.loop.next_id.left.value  # type: ignore[attr-defined]
        header = cst.ensure_type(cst.parse_statement(  # id start_layer is the first rank's (vLLM's layout)
            f"if {flat_source_of(updated_node.test)} and (\n    {idx} != self.start_layer or get_pp_group().is_first_rank\n):\n"
            "    pass\n"), cst.If)
        safe = _none_safe(updated_node, self.plan.hidden, self.plan.residual)
        return safe.with_changes(test=header.test, whitespace_before_test=header.whitespace_before_test)

    def _gather_captures(self, gather: cst.If) -> cst.If:
        """``if <test>: aux = [<the gather's value, of a instead of hidden> for a in aux]``."""
        assign = cst.ensure_type(cst.ensure_type(cst.ensure_type(gather.body, cst.IndentedBlock).body[0],
                                                 cst.SimpleStatementLine).body[0], cst.Assign)
        item = "state" if "state" not in names_in(assign.value) else "aux_state"
        value = cst.ensure_type(assign.value.visit(_Rename(self.hidden, item)), cst.BaseExpression)
        text = f"{self.aux} = [{source_of(value)} for {item} in {self.aux}]"
        indent = 4 + 4 * (self.blocks + 1)
        if indent + len(text) > LINE:  # vLLM's multi-line form
            text = f"{self.aux} = [\n    {source_of(value)}\n    for {item} in {self.aux}\n]"
        return cst.ensure_type(cst.parse_statement(f"if {source_of(gather.test)}:\n" + "".join(
            f"    {line}\n" for line in text.splitlines())), cst.If)

    def leave_Return(self, original_node: cst.Return, updated_node: cst.Return) -> cst.Return:
        if original_node not in self.nonlast:
            return updated_node
        call = cst.ensure_type(updated_node.value, cst.Call)
        pack = cst.parse_expression(f"self.pack_local_aux_hidden_states({self.aux})")
        if isinstance(call.args[0].value, cst.Name):  # IntermediateTensors(tensors): a dict built above
            merged = cst.parse_expression(f"{{**{call.args[0].value.value}, **{flat_source_of(pack)}}}")
            return updated_node.with_changes(value=call.with_changes(args=[call.args[0].with_changes(value=merged)]))
        table = cst.ensure_type(call.args[0].value, cst.Dict)
        plan = self.sent_by.get(original_node)
        zeroed = None if plan is None else self._zeroed_residual(plan)
        if zeroed is not None and plan is not None:
            table = table.with_changes(elements=[
                e.with_changes(value=cst.parse_expression(zeroed))
                if isinstance(e, cst.DictElement) and m.matches(e.value, m.Name(plan.residual)) else e
                for e in table.elements])
        elements = list(table.elements)
        last = elements[-1]
        sep = (elements[-2].comma if len(elements) > 1 and isinstance(elements[-2].comma, cst.Comma)
               else cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
        if isinstance(table.lbrace.whitespace_after, cst.ParenthesizedWhitespace) and len(elements) == 1:
            sep = cst.Comma(whitespace_after=table.lbrace.whitespace_after)
        new = cst.StarredDictElement(pack, comma=last.comma)
        elements[-1] = last.with_changes(comma=sep)
        table = table.with_changes(elements=[*elements, new])
        original = cst.ensure_type(call.args[0].value, cst.Dict)
        flat = f"return {source_of(call.func)}({source_of(original)[:-1]}, **{flat_source_of(pack)}}})"
        if "\n" not in source_of(original) and len(flat) + 12 + len(zeroed or "") > LINE:
            lines = []  # vLLM's multi-line form for a dict that no longer fits on one line
            for el in elements + [new]:
                pad = " " * (4 + 4 * self.blocks + 8)  # where vLLM's format puts the dict's entries
                one = f"{pad}{source_of(el.key)}: {source_of(el.value)}," if isinstance(el, cst.DictElement) else ""
                if isinstance(el, cst.DictElement) and isinstance(el.value, cst.IfExp) and len(one) > LINE:
                    lines.append(_split_conditional(source_of(el.key), el.value, len(pad)))
                elif isinstance(el, cst.DictElement):
                    lines.append(f"        {source_of(el.key)}: {source_of(el.value)},\n")
                else:
                    lines.append(f"        **{source_of(el.value)},\n")
            text = f"return {source_of(call.func)}(\n    {{\n{''.join(lines)}    }}\n)\n"
            return cst.ensure_type(cst.ensure_type(cst.parse_statement(text), cst.SimpleStatementLine).body[0], cst.Return)
        return updated_node.with_changes(value=call.with_changes(args=[call.args[0].with_changes(value=table)]))

    def leave_SimpleStatementLine(
        self, original_node: cst.SimpleStatementLine, updated_node: cst.SimpleStatementLine
    ) -> cst.BaseStatement | cst.FlattenSentinel[cst.BaseStatement]:
        rets = [s for s in original_node.body if s in self.last]
        if not rets:
            return updated_node
        ret = cst.ensure_type(rets[0], cst.Return)
        assert ret.value is not None
        value = source_of(ret.value)
        aux = self.aux
        lines = [
            cst.parse_statement(f"{aux} = {self.remote} + {aux}\n").with_changes(leading_lines=updated_node.leading_lines),
            cst.parse_statement(f"if len({aux}) > 0:\n    return {value}, {aux}\n"),
            cst.parse_statement(f"return {value}\n"),
        ]
        return cst.FlattenSentinel(lines)


def _split_conditional(key: str, value: cst.IfExp, pad: int) -> str:
    """``key: body if test else orelse,`` as ruff's format splits it where it does not fit, relative to
    the multi-line dict's entries (the ``and`` of a test that does not fit either on a line of its own)."""
    test = [f"if {source_of(value.test)}"]
    if pad + len(test[0]) > LINE and isinstance(value.test, cst.BooleanOperation):
        op = source_of(value.test.operator).strip()
        test = [f"if {source_of(value.test.left)}", f"{op} {source_of(value.test.right)}"]
    return "".join(f"        {line}\n" for line in (f"{key}: {source_of(value.body)}", *test,
                                                    f"else {source_of(value.orelse)},"))


class _Rename(cst.CSTTransformer):
    """Every ``Name(old)`` made ``Name(new)``."""

    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new

    def leave_Name(self, original_node: cst.Name, updated_node: cst.Name) -> cst.Name:
        return updated_node.with_changes(value=self.new) if updated_node.value == self.old else updated_node


def _none_safe(node: cst.If, hidden: str, residual: str | None) -> cst.If:
    """The model's own capture with every ``hidden + residual`` made right when ``residual`` is None
    (id ``start_layer`` on the first rank, where no layer has produced a residual yet)."""
    if residual is None:
        return node
    return cst.ensure_type(node.visit(_NoneSafeAdd(hidden, residual)), cst.If)


class _NoneSafeAdd(cst.CSTTransformer):
    """``h + r`` -> ``(h if r is None else h + r)`` (also ``r + h``); a form already guarded stays."""

    def __init__(self, hidden: str, residual: str) -> None:
        self.pair = {hidden, residual}
        self.residual = residual
        self.guarded = 0

    def visit_IfExp(self, node: cst.IfExp) -> None:
        if m.matches(node.test, m.Comparison(left=m.Name(self.residual), comparisons=[m.ComparisonTarget(m.Is() | m.IsNot())])):
            self.guarded += 1

    def leave_IfExp(self, original_node: cst.IfExp, updated_node: cst.IfExp) -> cst.BaseExpression:
        if m.matches(original_node.test, m.Comparison(left=m.Name(self.residual),
                                                      comparisons=[m.ComparisonTarget(m.Is() | m.IsNot())])):
            self.guarded -= 1
        return updated_node

    def leave_BinaryOperation(self, original_node: cst.BinaryOperation,
                              updated_node: cst.BinaryOperation) -> cst.BaseExpression:
        if self.guarded or not isinstance(updated_node.operator, cst.Add):
            return updated_node
        left, right = updated_node.left, updated_node.right
        if not (isinstance(left, cst.Name) and isinstance(right, cst.Name) and {left.value, right.value} == self.pair):
            return updated_node
        hidden = left.value if left.value != self.residual else right.value
        return cst.parse_expression(f"({hidden} if {self.residual} is None else {source_of(updated_node)})")


LINE = 88  # vLLM's line length (ruff format): generated lines longer than this are wrapped the way it would


def wrapped_call(func: str, args: list[str], indent: int) -> str:
    """``func(a, b)`` on one line when it fits at ``indent``, else vLLM's style (ruff format): the arguments
    on one indented line, or one a line when even that is too long."""
    flat = f"{func}({', '.join(args)})"
    if indent + len(flat) <= LINE:
        return flat + "\n"
    if indent + 4 + len(", ".join(args)) <= LINE:
        return f"{func}(\n    {', '.join(args)}\n)\n"
    return f"{func}(\n" + "".join(f"    {a},\n" for a in args) + ")\n"  # one argument a line
