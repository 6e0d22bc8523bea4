"""chatmesh.chat: ChatService, the turn state machine."""
