"""`python -m framework.plots` stays the command line; the module lives in its layer as `framework.train.plots`."""

import runpy

if __name__ == "__main__":
    runpy.run_module("framework.train.plots", run_name="__main__", alter_sys=True)
