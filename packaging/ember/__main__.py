"""`python -m ember` runs the CLI."""

import sys

from ember.cli.main import main

sys.exit(main())
