"""``python traced.py ROOT TRACE SCRIPT ARGS...``: run SCRIPT (a path) with ARGS under the tracer
(tracer.py), every change under ROOT recorded and pickled to TRACE at exit. Not a test module."""
import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tracer  # noqa: E402

if __name__ == "__main__":
    root, trace, script, *args = sys.argv[1:]
    os.environ["FASTIO_BACKEND"] = "pwrite"
    tracer.install(root, trace)
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
