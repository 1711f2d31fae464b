"""The start-up hook of the Python processes that thomas_tune's processes start
(:mod:`thomas_tune.startup.sitecustomize`)."""
