"""What both worker services share: lifecycle (engine thread, KV events, registry, health,
drain), proto ↔ engine conversion, and the mapping of errors to gRPC status codes."""
