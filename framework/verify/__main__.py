"""`python -m framework.verify` stays the command line; it lives in the launch layer as
`framework.launch.verify_cli` (`python -m framework ...`), whose help answers before torch is imported."""

import runpy

if __name__ == "__main__":
    runpy.run_module("framework.launch.verify_cli", run_name="__main__", alter_sys=True)
