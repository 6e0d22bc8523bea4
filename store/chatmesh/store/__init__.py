"""chatmesh.store: StoreService, durable conversation state."""
