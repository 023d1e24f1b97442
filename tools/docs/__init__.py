"""The doc generators: each renders the generated blocks of one page from ``registry/`` and
``registry/results`` JSON through ``tools.docs.docgen`` (write, or ``--check`` that the page is current);
``tools.docs.doc_samples`` writes the sample outputs of the pages from running their commands."""
