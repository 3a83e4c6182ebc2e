"""Every ```python block of README.md and docs/ runs as written, or is a marked fragment of a tested script.

How a block is read, from the line right before it and its own first line:

- ``<!-- fragment: examples/NAME.py -->`` on the line before the block (a Markdown viewer
  hides it): the block is cut from that script, and names it in a comment for its readers.
  The script must exist, be run by ``tests/package/test_examples.py``, and hold every code line
  of the fragment (comments and indentation aside), so a fragment cannot drift from the script
  that proves it.
- A first line ``# torchrun --standalone --nproc-per-node N FILE.py``: a complete program for
  several processes. It is saved as ``FILE.py`` and launched with that command line
  (``python -m torch.distributed.run`` standing in for ``torchrun``); with no GPU its ranks
  take gloo.
- Anything else is a complete program and runs as ``python block.py`` would, in a process of
  its own and an empty folder of its own. A block that leans on a name it does not define
  fails here with a ``NameError``.

Blocks written for GPUs run on the CPU: every string literal ``"cuda"`` or ``"cuda:N"`` in a
block becomes ``"cpu"`` (so ``devices=["cuda:0", "cuda:1"]`` becomes two CPU stages and
``torch.autocast("cuda", ...)`` CPU autocast). That is the only change made to a block.

Every process runs with ``OMP_NUM_THREADS=1``. To keep the module fast, the single-process
blocks share one server process that makes the blocks' top-level imports once and then forks
a child per block; the child runs the block as ``__main__`` and exits.
"""

from __future__ import annotations

import ast
import importlib.util
import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = next(p for p in Path(__file__).resolve().parents if (p / "setup.py").is_file())
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
EXAMPLE_TESTS = REPO / "tests" / "package" / "test_examples.py"
FRAGMENT = re.compile(r"^\s*<!--\s*fragment:\s*(\S+)\s*-->\s*$")
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
TORCHRUN = re.compile(r"^#\s*(torchrun\s.+\.py)\s*$")
CUDA_LITERAL = re.compile(r"""(["'])cuda(?::\d+)?\1""")
BLOCK_TIMEOUT = 120.0
ENV = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")


@dataclass(frozen=True)
class Block:
    """One ```python block: where it is, its code, and the fragment marker before it (if any)."""

    doc: Path
    line: int
    code: str
    fragment: str | None

    @property
    def name(self) -> str:
        return f"{self.doc.relative_to(REPO)}:{self.line}"

    @property
    def launch(self) -> list[str] | None:
        """The torchrun command line the block's first line gives, or None for one process."""
        first = self.code.splitlines()[0] if self.code.strip() else ""
        match = TORCHRUN.match(first)
        return shlex.split(match.group(1)) if match else None

    def runnable(self) -> str:
        """The code as the test runs it: CUDA device strings replaced by ``"cpu"``."""
        return CUDA_LITERAL.sub('"cpu"', self.code)

    def imports(self) -> set[str]:
        """The top-level packages the block imports."""
        found = set()
        for node in ast.walk(ast.parse(self.code)):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.add(node.module.split(".")[0])
        return found


def blocks_of(doc: Path) -> Iterator[Block]:
    """The ```python blocks of ``doc``, dedented to their fence.

    Raises:
        ValueError: a fence labelled with another Python spelling (it would escape the test),
            an unclosed block, or a fragment marker that no ```python block follows.
    """
    lines = doc.read_text().splitlines()
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        marker = FRAGMENT.match(lines[i])
        if marker:
            after = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
            if after is None or after.group(2) != "python":
                raise ValueError(
                    f"{doc.name}:{i + 1}: a fragment marker must sit on the line right before a ```python block"
                )
        if not fence:
            i += 1
            continue
        indent, label = fence.groups()
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            raise ValueError(f"{doc.name}:{i + 1}: the ``` block never closes")
        if label.lower() in ("py", "python3", "pycon", "ipython"):
            raise ValueError(f"{doc.name}:{i + 1}: label the block ```python so that the docs test runs it")
        if label == "python":
            code = "\n".join(line[len(indent) :] if line.startswith(indent) else line for line in lines[i + 1 : end])
            previous = FRAGMENT.match(lines[i - 1]) if i else None
            yield Block(doc, i + 1, code + "\n", previous.group(1) if previous else None)
        i = end + 1


def code_lines(source: str) -> list[str]:
    """The lines of ``source`` with comments, indentation and blank lines taken out."""
    comments: dict[int, int] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.start[1]
    out = []
    for n, line in enumerate(source.splitlines(), start=1):
        kept = line[: comments[n]] if n in comments else line
        if kept.strip():
            out.append(kept.strip())
    return out


ALL = [b for doc in DOCS for b in blocks_of(doc)]
COMPLETE = [b for b in ALL if b.fragment is None and b.launch is None]
TORCHRUN_BLOCKS = [b for b in ALL if b.fragment is None and b.launch is not None]
FRAGMENTS = [b for b in ALL if b.fragment is not None]
# Run beside the blocks: an incomplete program, to show the runner fails one.
CANARY = "model = nn.Sequential(...)  # a name this program never imports\n"


def serve(results: str, scripts: list[str]) -> None:
    """Run each script as ``__main__`` in a child forked from this process; write exit codes to ``results``.

    Invoked in a process of its own (see :func:`outcomes`). The scripts' top-level imports are
    made once, here, before the first fork (torch, fastpipe and transformers take seconds each
    to import); the children share nothing else.
    """
    import runpy
    import traceback

    for script in scripts:
        with open(script) as f:
            tree = ast.parse(f.read())
        imports = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
        try:
            exec(compile(ast.Module(body=imports, type_ignores=[]), script, "exec"), {})
        except Exception:
            pass  # the block's own run reports it

    done: dict[str, dict[str, object]] = {}
    for script in scripts:
        folder = tempfile.mkdtemp(prefix="fastpipe-doc-")
        log = os.path.join(folder, "output.txt")
        start = time.monotonic()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                fd = os.open(log, os.O_WRONLY | os.O_CREAT, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                os.chdir(folder)
                sys.argv = [script]
                sys.path[0] = os.path.dirname(script)  # as `python script.py` sets it
                runpy.run_path(script, run_name="__main__")
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        status = None
        while status is None and time.monotonic() - start < BLOCK_TIMEOUT:
            waited, raw = os.waitpid(pid, os.WNOHANG)
            status = os.waitstatus_to_exitcode(raw) if waited else None
            time.sleep(0.02 if status is None else 0)
        if status is None:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        with open(log, errors="replace") as f:
            output = f.read()
        done[script] = {"rc": status, "output": output[-6000:], "seconds": round(time.monotonic() - start, 2)}
    with open(results, "w") as f:
        json.dump(done, f)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, object]]:
    """Each one-process block's exit code and output, keyed by the block's name (and "canary")."""
    folder = tmp_path_factory.mktemp("blocks")
    scripts: dict[str, str] = {}
    for n, (name, code) in enumerate([*((b.name, b.runnable()) for b in COMPLETE), ("canary", CANARY)]):
        path = folder / f"block_{n}.py"
        path.write_text(code)
        scripts[str(path)] = name
    results = folder / "results.json"
    call = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_docs_run as t; "
    call += "t.serve(sys.argv[1], sys.argv[2:])"
    timeout = BLOCK_TIMEOUT * len(scripts) + 60
    proc = subprocess.run(
        [sys.executable, "-c", call, str(results), *scripts],
        cwd=folder,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"the block server failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return {scripts[path]: outcome for path, outcome in json.loads(results.read_text()).items()}


def test_docs_hold_python_blocks_of_every_kind() -> None:
    # The extraction itself: a parser that lost the blocks would make every other test vacuous.
    assert len(ALL) >= 20, [b.name for b in ALL]
    assert COMPLETE and TORCHRUN_BLOCKS and FRAGMENTS
    assert {b.doc.name for b in ALL} >= {"README.md", "pipe.md", "hf.md", "distributed.md", "checkpoints.md"}


def test_an_incomplete_block_fails_in_the_runner(outcomes: dict[str, dict[str, object]]) -> None:
    canary = outcomes["canary"]
    assert canary["rc"] == 1 and "NameError" in str(canary["output"]), canary


@pytest.mark.parametrize("block", COMPLETE, ids=lambda b: b.name)
def test_complete_block_runs_as_written(block: Block, outcomes: dict[str, dict[str, object]]) -> None:
    if "transformers" in block.imports() and importlib.util.find_spec("transformers") is None:
        pytest.skip('transformers is not installed (pip install ".[hf]")')
    got = outcomes[block.name]
    if got["rc"] is None:
        pytest.fail(f"{block.name}: over {BLOCK_TIMEOUT:.0f} s\n{got['output']}")
    assert got["rc"] == 0, (
        f"{block.name} no longer runs as written (or needs a fragment marker naming the script it is cut from):\n"
        f"{got['output']}"
    )


@pytest.mark.parametrize("block", TORCHRUN_BLOCKS, ids=lambda b: b.name)
def test_torchrun_block_runs_on_two_cpu_ranks(block: Block, tmp_path: Path) -> None:
    launch = block.launch
    assert launch is not None and launch[0] == "torchrun", launch
    assert "--standalone" in launch, f"{block.name}: say --standalone, so that two runs on one host never collide"
    script = tmp_path / launch[-1]
    script.write_text(block.runnable())
    # A session of its own, so that a block over its time takes its ranks down with the launcher:
    # killing the launcher alone leaves the ranks running, holding a port and a core.
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", *launch[1:]],
        cwd=tmp_path,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=BLOCK_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{block.name}: over {BLOCK_TIMEOUT:.0f} s\n{out[-3000:]}\n{err[-5000:]}")
    assert proc.returncode == 0, f"{block.name}: exit {proc.returncode}\n{out[-3000:]}\n{err[-5000:]}"


def fragment_problems(block: Block) -> list[str]:
    """What keeps ``block`` from being a fragment of a tested script (empty: nothing)."""
    assert block.fragment is not None
    script = REPO / block.fragment
    if not (block.fragment.startswith("examples/") and script.is_file()):
        return [f"{block.fragment} is not a script in examples/"]
    problems = []
    if f'"{script.name}"' not in EXAMPLE_TESTS.read_text():
        problems.append(f"{block.fragment} is run by no test in {EXAMPLE_TESTS.name}")
    if block.fragment not in block.code:
        problems.append(f"the block does not name {block.fragment} for its readers")
    whole = set(code_lines(script.read_text()))
    missing = [line for line in code_lines(block.code) if line not in whole]
    if missing:
        problems.append(f"lines not in {block.fragment}: {missing}")
    return problems


@pytest.mark.parametrize("block", FRAGMENTS, ids=lambda b: b.name)
def test_fragment_is_cut_from_a_tested_script(block: Block) -> None:
    assert not fragment_problems(block), f"{block.name}: {fragment_problems(block)}"


def test_a_fragment_that_drifted_from_its_script_is_refused() -> None:
    doc = REPO / "docs" / "pipe.md"
    cut = "# from examples/one_host.py\nloss = pipe.train_step(x, y, loss_fn)  # why\n"
    assert fragment_problems(Block(doc, 1, cut, "examples/one_host.py")) == []
    drifted = Block(doc, 1, cut.replace("loss_fn)", "loss_fn, scaler=scaler)"), "examples/one_host.py")
    assert fragment_problems(drifted) == [
        "lines not in examples/one_host.py: ['loss = pipe.train_step(x, y, loss_fn, scaler=scaler)']"
    ]
    unnamed = Block(doc, 1, "opt.step()\n", "examples/one_host.py")
    assert fragment_problems(unnamed) == ["the block does not name examples/one_host.py for its readers"]
    assert fragment_problems(Block(doc, 1, "opt.step()\n", "examples/gone.py")) == [
        "examples/gone.py is not a script in examples/"
    ]


def test_install_commands_install_from_the_checkout() -> None:
    # The name fastpipe on the public package index is an unrelated project without fastpipe's extras.
    by_name = re.compile(r"pip install\s+[\"']?fastpipe\b")
    found = [
        f"{doc.name}: {line.strip()}" for doc in DOCS for line in doc.read_text().splitlines() if by_name.search(line)
    ]
    assert not found, found
    assert 'pip install ".[hf]"' in (REPO / "docs" / "hf.md").read_text()


def test_markers_and_labels_are_read_strictly(tmp_path: Path) -> None:
    doc = tmp_path / "page.md"
    doc.write_text("<!-- fragment: examples/one_host.py -->\n```python\npipe = 1\n```\n\n```bash\nls\n```\n")
    (block,) = blocks_of(doc)
    assert block.fragment == "examples/one_host.py" and block.code == "pipe = 1\n"
    doc.write_text("<!-- fragment: examples/one_host.py -->\n\n```python\npipe = 1\n```\n")
    with pytest.raises(ValueError, match="right before"):
        list(blocks_of(doc))
    doc.write_text("```py\nimport torch\n```\n")
    with pytest.raises(ValueError, match="```python"):
        list(blocks_of(doc))
    doc.write_text('```python\n# torchrun --standalone --nproc-per-node 2 train.py\nd = "cuda:1"\n```\n')
    (block,) = blocks_of(doc)
    assert block.launch == ["torchrun", "--standalone", "--nproc-per-node", "2", "train.py"]
    assert block.runnable().endswith('d = "cpu"\n')
