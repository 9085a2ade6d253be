"""Models and data for compute islands. Nothing here knows of networks or swarms."""
