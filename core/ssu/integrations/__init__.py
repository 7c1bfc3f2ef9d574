"""Integrations of ssu with model libraries: each module imports its library only when used."""
