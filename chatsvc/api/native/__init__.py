"""The native API: sessions, their messages and branches, system prompts, admin, health."""
