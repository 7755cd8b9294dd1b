"""`python -m framework.generate` stays the command line; it runs `framework.launch.generate`, the
decoder's command line with a loader that also takes a Hugging Face folder (the decoder itself lives
in its layer as `framework.generate.decode`)."""

import runpy

if __name__ == "__main__":
    runpy.run_module("framework.launch.generate", run_name="__main__", alter_sys=True)
