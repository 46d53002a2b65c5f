"""distbuild: the build tool of the GLM-5.3 B300 serving distribution.

Steps, each importing only the steps below it:
pins -> index -> fetch -> series -> gitrepo -> prepare -> export -> health
-> manifest -> cli.
"""
