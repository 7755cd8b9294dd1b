"""`python -m framework.checkpoint` stays the command line; it lives in the launch layer as
`framework.launch.export_cli` (`python -m framework ...`), whose help answers before torch is imported."""

import runpy

if __name__ == "__main__":
    runpy.run_module("framework.launch.export_cli", run_name="__main__", alter_sys=True)
