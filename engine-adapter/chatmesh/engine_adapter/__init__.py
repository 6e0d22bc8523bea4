"""chatmesh.engine_adapter: one engine replica (GenerateService) and its backends."""
