"""`python -m framework.recipes` stays the command line; the module lives in its layer as `framework.launch.recipes`."""

import runpy

if __name__ == "__main__":
    runpy.run_module("framework.launch.recipes", run_name="__main__", alter_sys=True)
