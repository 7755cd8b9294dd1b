"""`python -m framework.recipes` stays the command line; the module lives in its layer as `framework.launch.recipe_cli`."""

import runpy

if __name__ == "__main__":
    runpy.run_module("framework.launch.recipe_cli", run_name="__main__", alter_sys=True)
