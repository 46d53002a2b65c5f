"""The build tool's host-only steps: what runs on the build host and never inside a build stage
(the image driver and its base maker, the arch audit, reproducibility, the locks, the test
runners, the chart package, the picture). No stage imports them, so the image's build context
leaves this folder out (.dockerignore) and editing them rebuilds no stage."""
