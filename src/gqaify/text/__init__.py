"""Text as gqaify reads it: `loading` (files, folders, hub datasets and the parent's corpora through `datasets`,
their tokens, EOS-packed blocks) and `corpus_format` (the folder `gqaify generate` writes, as its readers open it)."""
