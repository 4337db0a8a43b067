"""Cost model behind `python -m jaxdist.plan`: hardware table, layout, memory, communication, step time."""
