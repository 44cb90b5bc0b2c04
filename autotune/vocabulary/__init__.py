"""The words every layer shares: errors and exit statuses (errors), every status and stop reason
(status), one default per setting (defaults), sizes and durations as users type them (units), the
version, YAML written without a library (yaml_text), and how a --device is read (devices). Imports
nothing of autotune's but these."""
