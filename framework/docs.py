"""`python -m framework.docs` stays the command line; the module lives in its layer as `framework.launch.docs`."""

import runpy

if __name__ == "__main__":
    runpy.run_module("framework.launch.docs", run_name="__main__", alter_sys=True)
