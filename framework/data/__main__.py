import sys

from framework.data.cli import main

sys.exit(main())
