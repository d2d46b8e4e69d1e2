"""cuflash inside other libraries' attention registries
(``cuflash.integrations.transformers``)."""
