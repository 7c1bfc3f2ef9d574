"""Finding, configuring and choosing backends.

Entry-point discovery and loading (:mod:`.registry`), the configuration files and their precedence
(:mod:`.config`), resolving a configuration and a problem to one backend with a reason for every
other (:mod:`.resolve`), and what is checked before any problem is known (:mod:`.preflight`).
"""
