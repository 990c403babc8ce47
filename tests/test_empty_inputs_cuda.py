"""GPU tests: attention calls with nothing to compute, and batches with empty sequences, on both CUDA kernel families.

    python -m pytest -q -m cuda tests/test_empty_inputs_cuda.py

Every case of tests/test_empty_inputs.py GRID (no sequence, no query / key rows, max_seqlen 0, no query heads,
sequences without queries or keys among others), forward and forward + backward, impl="cuda" in bf16, must give
out 0 and lse -inf for queries that see no key, zero gradients where nothing is attended, no NaN, and the float64
naive attention elsewhere (check_step). A crash (a SIGSEGV in the host layer, a poisoned CUDA context) must fail its
case, not end the run: each kernel family runs the grid in one child process (the mma.sync kernels with
FLASHTRAIN_SM90=0, the Hopper TMA / wgmma kernels by default, on sm_90 only), which reports each step as it ends;
when a child dies, the step it was in fails with its exit status and a new child takes the remaining steps.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_empty_inputs import GRID, STEPS, check_step

pytestmark = pytest.mark.cuda
FAMILIES = {"sm80": {"FLASHTRAIN_SM90": "0"}, "sm90": {}}  # the environment of each family's child
CHILD_TIMEOUT_S = 300  # the first child of a family compiles its kernels (hd64, causal and not, forward and backward)
_ROOT = Path(__file__).resolve().parent.parent


def _child(family: str, steps: list[tuple[str, str]]) -> tuple[dict, tuple | None, str]:
    """Runs `steps` [(case, step)] in a child process of `family`: ({(case, step): problems} of the steps it
    finished, the step it was in when it died (None: it did not die inside one), why it ended)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(_ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("FLASHTRAIN_SM90", None)
    env.update(FAMILIES[family])
    try:
        proc = subprocess.run([sys.executable, __file__, json.dumps(steps)], env=env, capture_output=True, text=True,
                              timeout=CHILD_TIMEOUT_S, cwd=_ROOT)
        stdout, ending = proc.stdout, f"exit status {proc.returncode}: {proc.stderr[-3000:]}"
    except subprocess.TimeoutExpired as error:
        stdout = error.stdout.decode() if isinstance(error.stdout, bytes) else (error.stdout or "")
        ending = f"timed out after {CHILD_TIMEOUT_S} s"
    results, current = {}, None
    for line in stdout.splitlines():
        if line.startswith("BEGIN "):
            current = tuple(json.loads(line[len("BEGIN "):]))
        elif line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
            results[result["case"], result["step"]] = result["problems"]
            current = None
    return results, current, ending


@functools.lru_cache(maxsize=None)
def _family_results(family: str) -> dict:
    """{(case, step): problems} of the whole grid on `family`, in as few child processes as crashes allow."""
    results: dict = {}
    pending = [(name, step) for name in GRID for step in STEPS]
    while pending:
        finished, crashed_in, ending = _child(family, pending)
        results.update(finished)
        if crashed_in is not None:
            results[crashed_in] = [f"the child process died in this step ({ending})"]
        left = [item for item in pending if item not in results]
        if len(left) == len(pending):  # died before its first step: nothing will run
            for item in left:
                results[item] = [f"the child process ran no step ({ending})"]
            left = []
        pending = left
    return results


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("name", GRID)
@pytest.mark.parametrize("family", FAMILIES)
def test_empty_and_partly_empty_calls_on_the_kernels(family, name, step):
    if family == "sm90" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernels run on sm_90 (without it the default family is sm80's)")
    problems = _family_results(family)[name, step]
    assert problems == [], f"{family} {name} {step}: {problems}"


def _run_steps(steps: list[list[str]]) -> None:
    """The child: each (case, step) on impl="cuda" in bf16, announced before it runs and reported after. A CUDA error
    leaves the context unusable: the child reports the step and exits, for a new child to take the rest."""
    for name, step in steps:
        print("BEGIN " + json.dumps([name, step]), flush=True)
        try:
            problems = check_step(GRID[name], step, "cuda", torch.bfloat16, "cuda")
            torch.cuda.synchronize()
        except Exception as error:  # noqa: BLE001 (every failure is the case's result)
            problems = [f"{type(error).__name__}: {error}"[-2000:]]
            if "CUDA" in str(error) and "impl='cuda' cannot run" not in str(error):
                print("RESULT " + json.dumps({"case": name, "step": step, "problems": problems}), flush=True)
                sys.exit(3)
        print("RESULT " + json.dumps({"case": name, "step": step, "problems": problems}), flush=True)


if __name__ == "__main__":
    _run_steps(json.loads(sys.argv[1]))
