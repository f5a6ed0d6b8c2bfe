"""CPU seconds by process: what a server's process tree and the load generator spent while a load ran."""

from __future__ import annotations

import subprocess
import sys

import psutil

from benchmarks.process_cpu import LOAD_GENERATOR, CpuMeter, label

# Spins until it has used ``cpu_s`` of CPU, says so, then waits (idle) for stdin to close.
SPINNER = """
import sys, time
while time.process_time() < {cpu_s}:
    pass
print("spent", flush=True)
sys.stdin.read()
"""


def test_a_tree_is_charged_what_its_processes_spent_inside_the_block_and_the_load_generator_its_own() -> None:
    # the tree: a parent whose child burns 0.4 s of CPU inside the block
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys\n"
                               f"child = subprocess.Popen([sys.executable, '-c', {SPINNER.format(cpu_s=0.4)!r}])\n"
                               "child.wait()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        with CpuMeter([parent.pid]) as meter:
            assert parent.stdout is not None and parent.stdout.readline() == "spent\n"
            # a waited child of this process, as aiperf is: charged to the load generator
            subprocess.run([sys.executable, "-c", "import time\nwhile time.process_time() < 0.3: pass"], check=True)
    finally:
        parent.communicate("")
    tree = sum(seconds for name, seconds in meter.seconds.items() if name != LOAD_GENERATOR)
    assert 0.35 <= tree < 5
    assert meter.seconds[LOAD_GENERATOR] >= 0.25


def test_processes_are_labelled_by_the_module_they_run() -> None:
    proc = subprocess.Popen([sys.executable, "-u", "-m", "http.server", "0", "--bind", "127.0.0.1"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().startswith("Serving HTTP")  # it runs the module
        assert label(psutil.Process(proc.pid)) == "http.server"
    finally:
        proc.kill()
        proc.wait()
