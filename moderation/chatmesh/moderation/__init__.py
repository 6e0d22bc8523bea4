"""chatmesh.moderation: ModerateService, input and streamed output checks."""
