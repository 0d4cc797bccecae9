"""Run every example that the docs show, as a user would, so that the code in the guide cannot rot.

Every ``docs/source-fabric/examples/*.py`` is a complete script: it runs in a fresh process, in an empty working
directory, with none of the launcher variables (``LOCAL_RANK``, ``MASTER_PORT``, ...) set, so that ``Fabric(devices=2)``
and ``fabric.launch()`` start the other processes themselves. The test checks that the script exits with 0 and prints
each text that its ``# expect: <text>`` lines declare. A new example dropped into the folder is picked up by itself.

The guide may show Python only through ``.. literalinclude::`` of these files: an inline Python code block would not
be run, so it is refused here.
"""

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import lightning_fsdp
from tests.tests_fabric.helpers.env import without_launcher_variables

_DOCS = Path(__file__).resolve().parents[2] / "docs" / "source-fabric"
_EXAMPLES = sorted((_DOCS / "examples").glob("*.py"))
_EXPECT = re.compile(r"^# expect: (.+?)\s*$", re.MULTILINE)
_TIMEOUT = 180.0  # seconds; each example takes a few seconds, but the CI machine may be shared


# Python in a page must come from an executed file: `.. code-block:: python` (rst) or ```python (MyST) is refused.
_INLINE_PYTHON = re.compile(
    r"^\s*(?:\.\.\s+(?:code-block|code|sourcecode)::\s*(?:python3?|py|pycon|ipython3?)\s*$"
    r"|(?:```|~~~)\s*(?:\{(?:code-block|code)\}\s*)?(?:python3?|py|pycon|ipython3?)\s*$)",
    re.MULTILINE | re.IGNORECASE,
)


def _clean_env() -> dict[str, str]:
    env = without_launcher_variables()  # an example must not inherit what a launcher or an enclosing test set
    # Run the examples against the same copy of the package that this test session imports.
    package_root = str(Path(lightning_fsdp.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")  # two ranks on a small CI machine: no thread oversubscription
    return env


def _kill_process_group(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


def test_examples_exist():
    assert _EXAMPLES, f"no examples found in {_DOCS / 'examples'}"


@pytest.mark.skipif(sys.platform == "win32", reason="process groups and `os.killpg` are POSIX")
@pytest.mark.parametrize("example", _EXAMPLES, ids=[path.name for path in _EXAMPLES])
def test_docs_example_runs(example: Path, tmp_path: Path):
    expected = _EXPECT.findall(example.read_text(encoding="utf-8"))
    assert expected, (
        f"{example.name} declares no expected output: add a comment line `# expect: <text>` for each text that"
        " rank 0 prints (substring match), so that this test can tell that the example did its job."
    )
    # A session of its own: on timeout, the example and the processes that Fabric launched are killed together.
    process = subprocess.Popen(
        [sys.executable, str(example)],
        cwd=tmp_path,
        env=_clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=_TIMEOUT)
    except subprocess.TimeoutExpired:
        _kill_process_group(process)
        stdout, stderr = process.communicate()
        pytest.fail(f"{example.name} did not finish within {_TIMEOUT:.0f} s\n{_tail(stdout, stderr)}")
    finally:
        _kill_process_group(process)  # a rank that outlived rank 0

    assert process.returncode == 0, f"{example.name} exited with {process.returncode}\n{_tail(stdout, stderr)}"
    # what the example prints (stdout), or what the package logs while it runs (Lightning's loggers write to stderr)
    missing = [text for text in expected if text not in stdout and text not in stderr]
    assert not missing, f"{example.name} did not print {missing}\n{_tail(stdout, stderr)}"


def _tail(stdout: str, stderr: str, limit: int = 4000) -> str:
    return f"--- stdout (end) ---\n{stdout[-limit:]}\n--- stderr (end) ---\n{stderr[-limit:]}"


def test_docs_show_python_only_from_examples():
    # docs/source-fabric/core/ holds the fragments that the series writes into Lightning's own pages, whose examples
    # are `code-block`s (Lightning's docs have no example scripts); they are not part of this project's docs build
    pages = sorted(page for page in [*_DOCS.rglob("*.rst"), *_DOCS.rglob("*.md")] if "core" not in page.parts)
    offenders = []
    for page in pages:
        text = page.read_text(encoding="utf-8")
        for match in _INLINE_PYTHON.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            offenders.append(f"{page.relative_to(_DOCS)}:{line}: {match.group(0).strip()}")
    assert not offenders, (
        "Python code in the docs must be executed by the tests: put it in docs/source-fabric/examples/<name>.py"
        " (with `# expect:` lines) and show it with `.. literalinclude:: ../examples/<name>.py` (`:start-at:`,"
        " `:end-at:` or `:pyobject:` show a part). Inline Python blocks found:\n" + "\n".join(offenders)
    )
