"""`python -m framework.worker` stays the command line; the module lives in its layer as `framework.launch.worker`."""

import runpy

if __name__ == "__main__":
    runpy.run_module("framework.launch.worker", run_name="__main__", alter_sys=True)
