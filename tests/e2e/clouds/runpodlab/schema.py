"""The part of RunPod's GraphQL schema the runpod SDK (1.10.1) and SkyPilot 0.14.1 use, as SDL.

Names and shapes follow what the clients send and read (``runpod/api/mutations/pods.py``,
``runpod/api/queries/gpus.py``, ``sky/provision/runpod/utils.py`` and ``api/pods.py``) and
RunPod's public spec (graphql-spec.runpod.io) for the types' names. graphql-core parses and
validates every request against it: a field or argument the lab does not know is a GraphQL
error, as an unknown one is on RunPod — never silently ignored.
"""

SDL = """
scalar Void

enum CloudTypeEnum { ALL SECURE COMMUNITY }

input EnvironmentVariableInput { key: String! value: String }

input PodFindAndDeployOnDemandInput {
  name: String imageName: String cloudType: CloudTypeEnum startSsh: Boolean startJupyter: Boolean
  gpuTypeId: String supportPublicIp: Boolean gpuCount: Int volumeInGb: Int minVcpuCount: Int
  minMemoryInGb: Int allowedCudaVersions: [String] dataCenterId: String dockerArgs: String
  countryCode: String containerDiskInGb: Int ports: String volumeMountPath: String
  env: [EnvironmentVariableInput] templateId: String networkVolumeId: String minDownload: Int
  minUpload: Int cudaVersion: String volumeKey: String terminateAfter: String stopAfter: String
}

input PodRentInterruptableInput {
  name: String imageName: String! gpuTypeId: String! bidPerGpu: Float! volumeMountPath: String
  cloudType: CloudTypeEnum startSsh: Boolean startJupyter: Boolean supportPublicIp: Boolean
  gpuCount: Int minMemoryInGb: Int minVcpuCount: Int containerDiskInGb: Int volumeInGb: Int
  ports: String dockerArgs: String terminateAfter: String stopAfter: String dataCenterId: String
  countryCode: String networkVolumeId: String allowedCudaVersions: [String] minDownload: Int
  minUpload: Int cudaVersion: String templateId: String volumeKey: String
  env: [EnvironmentVariableInput]
}

input DeployCpuPodInput {
  name: String imageName: String cloudType: CloudTypeEnum startSsh: Boolean instanceId: String
  dataCenterId: String dockerArgs: String countryCode: String containerDiskInGb: Int ports: String
  volumeMountPath: String env: [EnvironmentVariableInput] templateId: String networkVolumeId: String
  minDownload: Int minUpload: Int supportPublicIp: Boolean
}

input PodTerminateInput { podId: String! }
input PodStopInput { podId: String! incrementVersion: Boolean }
input PodFilter { podId: String! }
input GpuTypeFilter { id: String ids: [String] }
input GpuLowestPriceInput { gpuCount: Int secureCloud: Boolean communityCloud: Boolean }
input UpdateUserSettingsInput { pubKey: String }

type LowestPrice { minimumBidPrice: Float uninterruptablePrice: Float stockStatus: String }

type GpuType {
  id: String! displayName: String maxGpuCount: Int manufacturer: String memoryInGb: Int
  cudaCores: Int secureCloud: Boolean communityCloud: Boolean securePrice: Float
  communityPrice: Float oneMonthPrice: Float threeMonthPrice: Float oneWeekPrice: Float
  communitySpotPrice: Float secureSpotPrice: Float
  lowestPrice(input: GpuLowestPriceInput): LowestPrice
}

type PodRuntimePort { ip: String isIpPublic: Boolean privatePort: Int publicPort: Int type: String }
type PodRuntime { uptimeInSeconds: Int ports: [PodRuntimePort] }
type Machine { podHostId: String gpuDisplayName: String }

type Pod {
  id: String! containerDiskInGb: Int containerRegistryAuthId: String costPerHr: Float
  desiredStatus: String dockerArgs: String dockerId: String env: [String] gpuCount: Int
  imageName: String lastStatusChange: String machineId: String memoryInGb: Float name: String
  podType: String port: Int ports: String uptimeSeconds: Int vcpuCount: Float volumeInGb: Float
  volumeMountPath: String runtime: PodRuntime machine: Machine
}

type NetworkVolume { id: String name: String size: Int dataCenterId: String }
type PodTemplate { id: String name: String imageName: String containerRegistryAuthId: String }

type User {
  id: String pubKey: String networkVolumes: [NetworkVolume] pods: [Pod] podTemplates: [PodTemplate]
}

type Query {
  myself: User
  gpuTypes(input: GpuTypeFilter): [GpuType]
  pod(input: PodFilter): Pod
}

type Mutation {
  podFindAndDeployOnDemand(input: PodFindAndDeployOnDemandInput): Pod
  podRentInterruptable(input: PodRentInterruptableInput!): Pod
  deployCpuPod(input: DeployCpuPodInput!): Pod
  podTerminate(input: PodTerminateInput!): Void
  podStop(input: PodStopInput!): Pod
  updateUserSettings(input: UpdateUserSettingsInput): User
  deleteTemplate(templateName: String): Void
}
"""
