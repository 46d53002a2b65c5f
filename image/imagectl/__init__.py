"""In-image tools of the serving image: entrypoint, role presets, self-test, SBOM, manifest.

Stdlib only, Python 3.11: they run in the image's venv and in its build
stages, and on the host in the tests.
"""
