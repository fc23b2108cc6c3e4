import sys

from gqaify.entry.cli import main

sys.exit(main())
