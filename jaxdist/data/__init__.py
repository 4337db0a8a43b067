"""Data (the `data` config section): the grain loader (loader.py), `python -m jaxdist.data prepare`
(prepare.py, chatprep.py), tokenizers, chat templates, documents, corpus manifests, the loss mask."""
