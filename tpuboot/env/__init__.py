"""The runtime environment: the metadata server, tpu-env, /etc/environment, and keeping them in sync."""
