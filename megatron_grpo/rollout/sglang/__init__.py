"""SGLang rollout: HTTP client, server launcher, weight-sync transports, the SGLangEngine."""
