"""Adapters that plug splitkv into other libraries. Each is imported explicitly (for example
``import splitkv.integrations.transformers``) and brings in its library only then: importing
splitkv itself loads none of them."""
