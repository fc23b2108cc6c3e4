"""`accelerate launch -m gqaify.uptrain --recipe FILE [--key value ...]` (or `python -m gqaify.uptrain`)."""

import sys

from gqaify.cli import main

if __name__ == "__main__":
    sys.exit(main(["uptrain", *sys.argv[1:]], prog="python -m gqaify.uptrain"))
