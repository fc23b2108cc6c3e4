"""The entry points: the `gqaify` command (`cli`), the stages it runs (`stages`), and the demo (`demo`)."""
