"""Not Python: the sandbox images' Dockerfiles and the offline base-image script, shipped as `agentrl.containers`
package data so that `agentrl sandbox build` finds them in an installed wheel as in a checkout."""
