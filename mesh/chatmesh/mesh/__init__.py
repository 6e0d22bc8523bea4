"""The shared bootstrap every chatmesh service uses: ids, config, logs, the gRPC server, the CLI."""
