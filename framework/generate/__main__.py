"""`python -m framework.generate` stays the command line; the module lives in its layer as `framework.generate.decode`."""

import runpy

if __name__ == "__main__":
    runpy.run_module("framework.generate.decode", run_name="__main__", alter_sys=True)
