"""What a newcomer's first command costs: run an eyas command against an empty cache and time its one-time steps.

    python scripts/first_run.py -- eyas generate "Write a short story about a robot learning to paint."

Runs the command with ``EYAS_CACHE`` set to a fresh temporary directory (kernels compiled, the GGUF converted, the
block kernel's options and the draft tree's step costs timed, all as on a machine that never ran eyas), and prints
each line eyas writes on stderr with the seconds since the start, then the total. Progress bars are dropped.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    a = p.parse_args()
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        p.error("give the command after --")
    with tempfile.TemporaryDirectory(prefix="eyas-first-run-") as cache:
        env = {**os.environ, "EYAS_CACHE": cache}
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for line in proc.stderr:
            line = line.rstrip()
            if line and "%|" not in line:  # tqdm bars (the GGUF conversion's) redraw in place
                print(f"{time.perf_counter() - t0:7.1f} s  {line[:160]}", flush=True)
        rc = proc.wait()
        print(f"{time.perf_counter() - t0:7.1f} s  exit {rc}; cache {cache} (removed)")
    return rc


if __name__ == "__main__":
    sys.exit(main())
