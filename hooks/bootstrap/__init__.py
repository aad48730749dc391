"""Directory that ``launch`` puts on PYTHONPATH (holds ``sitecustomize``)."""
