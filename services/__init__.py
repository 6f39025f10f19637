"""The five gpuwarden services. Each is a package with the same shape: ``__main__`` (wire and run), ``config``
(its own settings), ``handlers`` (its decisions over typed events). Services never import each other."""
