"""Ember's built-in technique plugins, each written exactly as a third-party plugin would be:
an entry point in the "ember" group, `ember.hookimpl`, and only Ember's documented API."""
