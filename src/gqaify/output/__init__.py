"""Nothing of the user's is lost, in one room: what a command may write and what --force may replace
(`destination`), a file or folder written whole (`whole`), one run at a time per OUT (`claims`), and what killed
runs left beside OUT (`leftovers`)."""
