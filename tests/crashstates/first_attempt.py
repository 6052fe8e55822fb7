"""``first_attempt.py SCRIPT ARGS...`` under torchrun: on the job's first start, the rank named by
``FIRST_ATTEMPT_RANK`` gets ``LOWDIFF_FAULT=$FIRST_ATTEMPT_FAULT`` (it SIGKILLs itself at that
crash point, lowdiff/faults.py); restarts run clean. Then runs SCRIPT. Not a test module."""
import os
import runpy
import sys

if __name__ == "__main__":
    os.environ.pop("LOWDIFF_FAULT", None)
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and \
            os.environ.get("RANK") == os.environ.get("FIRST_ATTEMPT_RANK"):
        os.environ["LOWDIFF_FAULT"] = os.environ["FIRST_ATTEMPT_FAULT"]
    script, *args = sys.argv[1:]
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
