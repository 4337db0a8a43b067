"""python -m jaxdist.config: print the README's key reference (paste it between the config-keys marks)."""

from jaxdist.config.keys import keys_markdown

print(keys_markdown())
