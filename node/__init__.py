"""The islands-node daemon, its command line and its configuration."""
