import sys

from gqaify.cli import main

sys.exit(main())
