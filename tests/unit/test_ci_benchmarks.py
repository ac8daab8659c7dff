"""CI runs every benchmark once: the short modes no test runs in its own step (`.ci/run`,
`python -m bench --quick --only ...`), the others as the tests of `make test` that start
them. A benchmark added to `bench.BENCHMARKS` with neither fails here."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from bench.__main__ import BENCHMARKS

REPO = Path(__file__).resolve().parents[2]


def ci_benchmarks() -> list[str]:
    """The names after `--only` in `.ci/run`'s benchmark step (its continuation lines
    joined)."""
    script = (REPO / ".ci" / "run").read_text().replace("\\\n", " ")
    (line,) = [line for line in script.splitlines() if "-m bench --quick" in line]
    words = shlex.split(line.split("<", 1)[0])
    return words[words.index("--only") + 1 :]


def started_by_a_test(name: str) -> list[Path]:
    """Test files that start benchmark `name`: `-m bench.NAME`, or `-m bench ... --only`
    naming it."""
    found = []
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        text = path.read_text()
        if f'"bench.{name}"' in text or re.search(rf'"--only",[^\]]*"{name}"', text):
            found.append(path)
    return found


def test_the_ci_step_names_benchmarks_that_exist() -> None:
    names = ci_benchmarks()
    assert names, "the CI benchmark step names none"
    assert set(names) <= set(BENCHMARKS), set(names) - set(BENCHMARKS)


def test_every_benchmark_runs_in_ci_by_its_step_or_a_test() -> None:
    in_step = set(ci_benchmarks())
    missing = [n for n in BENCHMARKS if n not in in_step and not started_by_a_test(n)]
    assert not missing, (
        f"{missing}: no test starts them and .ci/run's benchmark step does not name them; "
        "add them to its --only list"
    )


def test_the_step_leaves_out_only_what_a_test_starts() -> None:
    """The reading above is not vacuous: what the step leaves out, tests start."""
    left_out = [n for n in BENCHMARKS if n not in ci_benchmarks()]
    assert left_out
    assert all(started_by_a_test(n) for n in left_out)
    assert started_by_a_test("resize") == [REPO / "tests/integration/test_bench_resize.py"]
