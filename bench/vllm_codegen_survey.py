"""Survey: the source zoo over a vLLM tree, plus (optionally) an import of each adapted module inside vLLM.

    .venv/bin/python bench/vllm_codegen_survey.py [--vllm TREE_OR_VERSION] [--json] [--import-check]

TREE_OR_VERSION is a ``vllm`` package directory or a release number (default: ``.venv-vllm``'s installed
package). The rows are ``pipespec.codegen.vllm_source_zoo.run_source_zoo``'s (``pipespec zoo --engine vllm
--source``): every model file read, never imported, each file's siblings read from the same tree by
their real paths (so the result does not depend on the working directory or on an installed vLLM).
``--import-check`` (run it with
``.venv-vllm/bin/python``) also imports each adapted module, from a temporary file, as a module of its
source's package (``vllm.model_executor.models.<name>_pipespec``) so relative imports resolve; a failure
is told apart from an environment that cannot import the original either.
Prints per-decoder lines and the totals; ``--json`` prints one JSON object instead.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import traceback
import types
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_VLLM = ROOT / ".venv-vllm" / "lib" / "python3.11" / "site-packages" / "vllm"


def survey(source: str, import_check: bool = False, jobs: int = 1) -> dict[str, object]:
    from pipespec.codegen.source_zoo import CodemodStatus
    from pipespec.codegen.vllm_source_zoo import run_source_zoo
    from pipespec.codemods.adapt_vllm_native import adapt_vllm_module
    from pipespec.codemods.vllm_native_index import default_reader

    zoo = run_source_zoo(source, jobs=jobs)
    imported: dict[str, str] = {}
    if import_check:
        for rel in dict.fromkeys(r.file for r in zoo.rows if r.codemod is CodemodStatus.ADAPTED):
            path = zoo.tree / rel
            code = adapt_vllm_module(path.read_text(encoding="utf-8"), label=f"vllm/{rel}",
                                     read_module=default_reader(str(path))).code
            imported[rel] = import_adapted(path, code, zoo.tree)
    rows = [{**r.to_json(), "import": imported.get(r.file) if r.codemod is CodemodStatus.ADAPTED else None} for r in zoo.rows]
    counts = Counter(str(r["status"]) for r in rows)
    return {"vllm": zoo.release, "tree": str(zoo.tree), "decoders": len(rows), "counts": dict(counts),
            "files_with_pp_handoff": len(zoo.files()), "files_ready": len(zoo.ready_files()),
            "model_files_read": zoo.files_read, "wall_s": round(zoo.wall_s, 1), "rows": rows,
            "import_failures": sum(1 for r in rows if r["import"] not in (None, "ok") and not str(r["import"]).startswith("env:")),
            "import_env_failures": sum(1 for r in rows if str(r["import"]).startswith("env:"))}


def import_adapted(path: Path, code: str, vllm_dir: Path) -> str:
    """Compile and import the adapted module as ``<package>.<name>_pipespec`` (so its relative imports
    resolve inside vLLM) from a temporary file; "ok", or the error's last line. Nothing is written into
    the vLLM tree."""
    try:
        compile(code, str(path), "exec")
    except SyntaxError as exc:
        return f"SyntaxError: line {exc.lineno}: {exc.msg}"
    package = ".".join(path.parent.relative_to(vllm_dir.parent).parts)
    name = f"{package}.{path.stem}_pipespec"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / f"{path.stem}_pipespec.py"
        out.write_text(code, encoding="utf-8")
        try:
            load_as(name, out)
        except Exception as exc:  # report, keep surveying
            last = traceback.format_exception_only(type(exc), exc)[-1].strip()[:300]
            if "register an operator" in last:  # the original, imported here already, registered its ops
                return import_in_own_process(name, out)
        else:
            return "ok"
        finally:
            sys.modules.pop(name, None)
    try:  # does the unadapted module import here? If not, the environment is missing something, not us
        importlib.import_module(f"{package}.{path.stem}")
    except Exception as exc:
        original = traceback.format_exception_only(type(exc), exc)[-1].strip()[:300]
        return f"env: the original does not import either ({original})"
    return last


def import_in_own_process(name: str, path: Path) -> str:
    """A module that registers custom ops at import cannot share a process with its original."""
    code = ("import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location({name!r}, {str(path)!r})\n"
            "module = importlib.util.module_from_spec(spec); sys.modules[spec.name] = module\n"
            "spec.loader.exec_module(module)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    if proc.returncode == 0:
        return "ok"
    return (proc.stderr.strip().splitlines() or ["failed"])[-1][:300]


def load_as(name: str, path: Path) -> types.ModuleType:
    """Import the file at ``path`` as module ``name`` (its package is what relative imports resolve in)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm", default=str(DEFAULT_VLLM), metavar="TREE_OR_VERSION",
                        help="a vllm package directory or a release number such as 0.34.0 (default: .venv-vllm's)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--import-check", action="store_true", help="also import each adapted module inside vLLM")
    parser.add_argument("--jobs", type=int, default=1, help="processes for the codemod (default 1)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from pipespec.errors import UsageError

    try:
        result = survey(args.vllm, args.import_check, max(1, args.jobs))
    except UsageError as exc:
        print(f"--vllm: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    for r in result["rows"]:  # type: ignore[union-attr]
        extra = f"  [import: {r['import']}]" if r["import"] not in (None, "ok") else ""
        print(f"{r['status']:9} {r['file']}:{r['class']}  {r['reason']}{extra}")
    print(f"vLLM {result['vllm']}: PP decoders: {result['decoders']}  {result['counts']}  files with a PP hand-off "
          f"adapted, unchanged or supported: {result['files_ready']} of {result['files_with_pp_handoff']}  "
          f"import failures: {result['import_failures']} "
          f"(+{result['import_env_failures']} whose original does not import here either)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
