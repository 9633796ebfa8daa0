//! Nothing users see changes when the engine's insides move: for 5 prompts ×
//! 7 policies (full, window, h2o, snapkv, adakv, epikv, epikv-lag) at a
//! budget every one of them must evict under, the SHA-256 of the greedy token
//! ids and of the f32 logits at every position (each prompt position, then
//! each decoded step) must equal the hashes recorded before the device-seam
//! redesign (on commit 00f5acf).
//!
//! Floating-point results depend on which kernels the CPU runs (the AVX-512
//! attention/GEMM paths sum in another order than the AVX2/scalar ones), so
//! hashes are recorded per kernel profile: avx2 on 00f5acf; avx512 and
//! avx512-vnni later, once an AVX-512 machine had checked the avx2 ones at
//! `KVRUN_CPU=avx2`. The test reruns itself at every lower level the CPU
//! runs. A profile without recorded hashes still checks what it can on its
//! own: two runs of every case are identical, and the run is identical with
//! 1 and 2 threads.

use crate::util;

use clap::Parser;
use kvrun::cmd::args::KvArgs;
use kvrun::format::gguf::Gguf;
use kvrun::model::llama::Logits;
use kvrun::model::Weights;
use kvrun::sample::argmax;
use kvrun::tokenizer::Tokenizer;
use sha2::{Digest, Sha256};

#[derive(Parser, Debug)]
struct Flags {
    #[command(flatten)]
    kv: KvArgs,
}

const PROMPTS: [&str; 5] = [
    "The quick brown fox jumps over the lazy dog. In the beginning the universe was created; this has made a lot of people very angry and been widely regarded as a bad move.",
    "Question: A train leaves the station at 3 pm travelling at 60 miles per hour. A second train leaves at 4 pm at 80 miles per hour. When does the second train catch up? Answer:",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n    return",
    "Robert Boulter is an English film, television and theatre actor. He had a guest starring role on the television series The Bill in 2000. This was followed by",
    "List three facts about the Moon:\n1. The Moon orbits the Earth about once every 27 days.\n2.",
];

const POLICIES: [&str; 7] = [
    "full",
    "window",
    "h2o",
    "snapkv",
    "adakv",
    "epikv",
    "epikv-lag",
];

const BUDGET: usize = 80;
const N_GEN: usize = 80;

/// (profile, prompt index, policy, sha256(tokens), sha256(logits)).
const RECORDED: &[(&str, usize, &str, &str, &str)] = &[
    (
        "avx2",
        0,
        "full",
        "a44dc035a60e95ddcc6bb0dfccd044ba796474f1a2efec62157e19eab2d6fb44",
        "e9ac5d6d48d4442e80353dc86fadc07ee88d9455af8e1d1ebfe8fe588bb5c471",
    ),
    (
        "avx2",
        0,
        "window",
        "6bd99732bca85a19653c4642e8c4ac7eb16f845cb8b1e544aeaaa323abc03bac",
        "3c3665de01bcf66f25b7c5e05194b632077612581799f5c4100df752d1d47d9a",
    ),
    (
        "avx2",
        0,
        "h2o",
        "c91df3599f11d9a72d1332a9d0fa24fb11dbf703ebca7566309e1f3b555ccd9d",
        "41c840edf2559194ab86ec39759802c30b8e24f829419ba60a227d1bb36e51f3",
    ),
    (
        "avx2",
        0,
        "snapkv",
        "079f43a1935a155e95d4ae3cecc5455e37ae62bd985449a09d113ed5f646d5af",
        "c899d9018237c51d427cde805f41d5d5537241df0a737b56ed8346a70d7bbd42",
    ),
    (
        "avx2",
        0,
        "adakv",
        "75cc8bc3e466cc86155c508d96b45387897ec9b9fd970bf168cf530a14607c2d",
        "3fa6bf7fa0a9aee3aeceeb92f53ee5ec8373172361eac98a8df949e1e769efdf",
    ),
    (
        "avx2",
        0,
        "epikv",
        "580b1c07da313e1f191355e429a3fdb0957beca054f3f840e50b769dc42c6c3d",
        "85228ea2012f5ba5f97175e69a383b4074f913bf9eef8d54fe89b213b9ae8960",
    ),
    (
        "avx2",
        0,
        "epikv-lag",
        "5851f19bcac18766ec3585f899449825847e9b7084ab1f02b8bf353d6f1124fd",
        "b617ff2934ee86d8d274f9a1910eae476858a919a6ba2f0bd1e16cd7bcb8f326",
    ),
    (
        "avx2",
        1,
        "full",
        "e1390660113518a402e025b003804c5d94c8eda7ba909be1bcbb4ac5b25aae0c",
        "1513ce41c2321ec03402a73359afff4194b3d60aa45a35666cf0fc42028295ed",
    ),
    (
        "avx2",
        1,
        "window",
        "df5a7e4be30d63352b633d33e1490c9c003bd84ac7d8367d81b4057d21c163bb",
        "b99562bc829ec35db638024066390e0d131b9c83846040d11404159e4c85d60e",
    ),
    (
        "avx2",
        1,
        "h2o",
        "4521404ac4e4566224fe3367b528bf3781c1632f7533200872e95bf30e06adde",
        "3917210e94f23ab6562291e02243fc22b3eeb675d5f0880e5e4f0fcf0a2a2be2",
    ),
    (
        "avx2",
        1,
        "snapkv",
        "eaab55581e1b0ebbfa46c8d51736ad18f76db43d4ac57715f5b86d6257ec616a",
        "ec59d1d093f791c4fba4eade83dc6bc65e4500eb498bc03789f9795e9751040e",
    ),
    (
        "avx2",
        1,
        "adakv",
        "6d140f364e5f014501c7d347449cb5f2c84025fe88048db2fc6472e47cebf2d4",
        "d2985f461d2ae4cf8a9bd2e21f9a20353b16665db9f70abe051b0fe45dbde99d",
    ),
    (
        "avx2",
        1,
        "epikv",
        "ef84cdc985263b78aee558a2e1887c97ad932a18ff1e2b15ac8f34f23ebcb359",
        "7ed697dc7891edd892647d531ac26907b4487f0f4a7a7171e53cf98fde15371b",
    ),
    (
        "avx2",
        1,
        "epikv-lag",
        "01ddc294582b1ac3b6a4a87a54d3cea25b0aa2238849d740d1f15d463498d32f",
        "ec75406962cf01ad056c2d589ecf9b3daf17fb440f291d86cfd31fd8120034b2",
    ),
    (
        "avx2",
        2,
        "full",
        "8004acba269021bf8fe6fb0dd96326002cb3e0438f89b33a88d36af5febe041f",
        "3e3a1842b9a9dc5796995b706777ecef022f446de630ff110066de50064522d4",
    ),
    (
        "avx2",
        2,
        "window",
        "8004acba269021bf8fe6fb0dd96326002cb3e0438f89b33a88d36af5febe041f",
        "9f0a0cfd6458808c6a42c02a6642e594b977a110e390689e1edd7337a1c42fbc",
    ),
    (
        "avx2",
        2,
        "h2o",
        "8004acba269021bf8fe6fb0dd96326002cb3e0438f89b33a88d36af5febe041f",
        "059b89404f6e127b74843cc59ce2924ec68b5b12737f6a547c408e9ec29743cc",
    ),
    (
        "avx2",
        2,
        "snapkv",
        "8004acba269021bf8fe6fb0dd96326002cb3e0438f89b33a88d36af5febe041f",
        "0a47f74be5ac9f30b8c1450ed82b1e923c9bf2c82011c37a6b347917d345b8da",
    ),
    (
        "avx2",
        2,
        "adakv",
        "8004acba269021bf8fe6fb0dd96326002cb3e0438f89b33a88d36af5febe041f",
        "94e53d8fe24a26889062623a29be0ccd9f5f909f9485c7889002f3dd2ccb1236",
    ),
    (
        "avx2",
        2,
        "epikv",
        "2348d081d133c1cc3140d728e58e625be7f728dc2c9d7d648460b40d588b3c49",
        "75ec2f9d5c81a113827a12637b32200d981f819e185af4912118c4ca50797c18",
    ),
    (
        "avx2",
        2,
        "epikv-lag",
        "e39cc1b2e9968b87942c3690e5137c838fc99276428cf69b02d93c33988bfd77",
        "9e8a04f1663538b976eccd02bf39279074de09075a1d7a906be2abd6064ab647",
    ),
    (
        "avx2",
        3,
        "full",
        "318c80b5aae01e5a95094de02978388f6477a483a3d76872cf6bd1bc5c4c2c72",
        "59b9f9061f6eab0e73c2863b7349b3fd3bab3e2e6d48b35dbe460417ddea3144",
    ),
    (
        "avx2",
        3,
        "window",
        "318c80b5aae01e5a95094de02978388f6477a483a3d76872cf6bd1bc5c4c2c72",
        "dd16c2feca3f375b70d67cec26132cb6d570b5fff8561ba5deb09b784edbc7ff",
    ),
    (
        "avx2",
        3,
        "h2o",
        "318c80b5aae01e5a95094de02978388f6477a483a3d76872cf6bd1bc5c4c2c72",
        "41bde999a7a86cbf6863043333658ce8007736b5464afaa39ca20231bb86557a",
    ),
    (
        "avx2",
        3,
        "snapkv",
        "318c80b5aae01e5a95094de02978388f6477a483a3d76872cf6bd1bc5c4c2c72",
        "f6505d55fb88ebc89ef1e1dc6d5c2076af274ced6bfb563d0749e8ac613f3d5f",
    ),
    (
        "avx2",
        3,
        "adakv",
        "27c8c2406e6eff77c9f1b382ca444786806991fc36829402637681a9e9b66448",
        "c0fe589c8d35e3860ebad150b7a34574a507f254f106e7366e0fb6f179cc4d10",
    ),
    (
        "avx2",
        3,
        "epikv",
        "318c80b5aae01e5a95094de02978388f6477a483a3d76872cf6bd1bc5c4c2c72",
        "e468a03f16141ea7015a6fc720f334df858161247e34a71ad32da26ebdc6b168",
    ),
    (
        "avx2",
        3,
        "epikv-lag",
        "318c80b5aae01e5a95094de02978388f6477a483a3d76872cf6bd1bc5c4c2c72",
        "56b9d6031c13078c4471ed51967b19d4a56ba61ad8094312aba4be22a4882c6b",
    ),
    (
        "avx2",
        4,
        "full",
        "a6118d2b38f905e1a2508f4aeb7c90811f44ba86247101ec4a154af3fe402a1a",
        "65963c712155486643ef7f0187081040c3bb79ac062fa5f98a4e0e09abda2120",
    ),
    (
        "avx2",
        4,
        "window",
        "a6118d2b38f905e1a2508f4aeb7c90811f44ba86247101ec4a154af3fe402a1a",
        "a5a11c2fd26c74105b50902f555fd7707f7051528e028764d16a35d7465ec4bf",
    ),
    (
        "avx2",
        4,
        "h2o",
        "a6118d2b38f905e1a2508f4aeb7c90811f44ba86247101ec4a154af3fe402a1a",
        "0968403d44174c593a226a8e8eea5018db7c1aaf57768b01011b558dd4f2c068",
    ),
    (
        "avx2",
        4,
        "snapkv",
        "a6118d2b38f905e1a2508f4aeb7c90811f44ba86247101ec4a154af3fe402a1a",
        "33bd5392eb2fefc2c55859dbae8c3f90d863a542ef6a793d96c442e82bf90b5d",
    ),
    (
        "avx2",
        4,
        "adakv",
        "a6118d2b38f905e1a2508f4aeb7c90811f44ba86247101ec4a154af3fe402a1a",
        "8d93f315ef62cf7716137d10079adb03f676b4e9f1e21de2397a6265e05efdf5",
    ),
    (
        "avx2",
        4,
        "epikv",
        "a6118d2b38f905e1a2508f4aeb7c90811f44ba86247101ec4a154af3fe402a1a",
        "de5ad0113454b5ab5fa84538418c53f582d46c1dcecfb89824c38b7f373ec8c7",
    ),
    (
        "avx2",
        4,
        "epikv-lag",
        "a6118d2b38f905e1a2508f4aeb7c90811f44ba86247101ec4a154af3fe402a1a",
        "6aa502b085fad0058e6682a911fdd0ed39c5903ab5030a4238afd67b91bcb84a",
    ),
    (
        "avx512",
        0,
        "full",
        "697f31d5816026fa77a20528bb5d0ab50971fd13cffd0e0ccc1fcf4ff091cf27",
        "c0bc95e3df5144f49ae1e375da1a517a13f1a4649ae28925c518dd24fe66f7fd",
    ),
    (
        "avx512",
        0,
        "window",
        "697f31d5816026fa77a20528bb5d0ab50971fd13cffd0e0ccc1fcf4ff091cf27",
        "2c69389b914cad3716dd597eef9d2f889fcf8a766f5c82aa6c40a6d78b902c68",
    ),
    (
        "avx512",
        0,
        "h2o",
        "c4ae698e22eb3b8aef2c51e0fd111894cab8c53fcaa5daf8315631d633d2fb5d",
        "f11d3011ed23fbbc020eef0a827a053bf6782acc2921688a7bcbf4dc36a5ea84",
    ),
    (
        "avx512",
        0,
        "snapkv",
        "697f31d5816026fa77a20528bb5d0ab50971fd13cffd0e0ccc1fcf4ff091cf27",
        "930f9ecd96bf7d114cdbfb3f2e0c8496a88d9819cb582b8096a14b62399c878f",
    ),
    (
        "avx512",
        0,
        "adakv",
        "697f31d5816026fa77a20528bb5d0ab50971fd13cffd0e0ccc1fcf4ff091cf27",
        "5a270ee48934669c97ad2fbb0e1eb432071f23a7ab08c735826ac13f88d5a788",
    ),
    (
        "avx512",
        0,
        "epikv",
        "ea006ed665c33e5d4e74770feff599291f59e49f59dbc730a21577e9fac48727",
        "802e09411f7f981a0f043b41c61d4f7c24756c6bc24303739ceed63f6b9c5093",
    ),
    (
        "avx512",
        0,
        "epikv-lag",
        "72cb16be001caac62ae39fb3011484860a70887993ffd985233033fcdeda3e8f",
        "ed851d548f1ec8743b514ad904a725e1ce788fcf5fb49d7d2ab8c12eb25bf00d",
    ),
    (
        "avx512",
        1,
        "full",
        "e1390660113518a402e025b003804c5d94c8eda7ba909be1bcbb4ac5b25aae0c",
        "caa2a1a6329ab3f1173521ebd64e60e127b33be69c6081ee690c4ba4d0cc673c",
    ),
    (
        "avx512",
        1,
        "window",
        "df5a7e4be30d63352b633d33e1490c9c003bd84ac7d8367d81b4057d21c163bb",
        "09b96db17dad0099bc468f1d16e7c2fdc1dd1e44ef0dd7e02c89d3848f8e02ae",
    ),
    (
        "avx512",
        1,
        "h2o",
        "4521404ac4e4566224fe3367b528bf3781c1632f7533200872e95bf30e06adde",
        "e15867883ac83e848f086dcbe72a133e43612151bfff4309174c338fe904931a",
    ),
    (
        "avx512",
        1,
        "snapkv",
        "9612037925f8ffae547e6d1dee77419cbc43ed049fa37f87a0472a808077cca5",
        "3a4d2ec6bb59dce0ce7408c2649ea334761f0e34e1ece000b283d0ea8127535a",
    ),
    (
        "avx512",
        1,
        "adakv",
        "2e1a0e6e8d0a764304854b4871686b3a87231116fc3798fab69bb97ffcac0120",
        "3358d8c2e2e8d8354043340a680910fbc9fc3fe409f501c1a8f220aa22d88fd2",
    ),
    (
        "avx512",
        1,
        "epikv",
        "ef84cdc985263b78aee558a2e1887c97ad932a18ff1e2b15ac8f34f23ebcb359",
        "804ae3c9594a074b20cac9d4b0243e7b526ead1106a457dcbac2f971315b75b9",
    ),
    (
        "avx512",
        1,
        "epikv-lag",
        "9098deb2bcdbc444707efd31d1dbbb73a65086e934ba306ae3f33375a8a6b7f3",
        "e1fa1fb0b5f2fb1a9a57333f6bd40955da2897144c5a7860eeb22170a2a3eb1f",
    ),
    (
        "avx512",
        2,
        "full",
        "bb78243c384bfdf03d86fa9cc04435f5779e76f53156308bf2f0359698bd099a",
        "47a65cfa808b453c64f8ab5545c98a0dff5bc114377d2b768ff6d26d7f4285fb",
    ),
    (
        "avx512",
        2,
        "window",
        "a7b13f173bf03344ea55b34a7c16ca965bcadfc397c1564dfb8ed57d360faf8f",
        "1d2a5fa60dd20e7699afb8a5118ae0b15430dd1d9395629aea6ce53cbd9d80ab",
    ),
    (
        "avx512",
        2,
        "h2o",
        "6e9da447c0c41f22a4305c5bfd7fa01294770bb96db7f32ce871282e9ab8a61f",
        "f181bde634d6761c3b14be59e3410aa9bf00917bd8e4dbd864c9a2dcc36fbd61",
    ),
    (
        "avx512",
        2,
        "snapkv",
        "cd310631f3677ec65b52307d8716d6a540897507f86911bb040d292754544c72",
        "49049e6ff7fcc9aefb15f61cf6bfa22d28dc4dac4f8c3fc6d2ea8936b2b6680e",
    ),
    (
        "avx512",
        2,
        "adakv",
        "617b440d239e4282187b29d4f376bfb12ed5bd17b53f00ceeb1eda554ed2049e",
        "dc6ab50c3b86decb7f6bde7f0fa2cee921de1896dbaa83e64d2b8d1fc1627a76",
    ),
    (
        "avx512",
        2,
        "epikv",
        "af806138fbd22d4b7cc8e7122fcf664ae285f9aaabe93ee1c14a9bca586c6b0c",
        "818729a8d1d1646dbf75bf1fda8ba6502d79a7e977e40755ada9cb42403b57b0",
    ),
    (
        "avx512",
        2,
        "epikv-lag",
        "52ddf992fb12e9509226b87716576e282af35d773bbc21234b659eaed91c7c96",
        "878721b89d330d4d19784f613f2355fc7fe6b6ddf63502274fe0df0106b4ff81",
    ),
    (
        "avx512",
        3,
        "full",
        "318c80b5aae01e5a95094de02978388f6477a483a3d76872cf6bd1bc5c4c2c72",
        "e8fe9c4028a390742a88e506c9db468c43cecc852cf65866fe62ae4f01510f73",
    ),
    (
        "avx512",
        3,
        "window",
        "318c80b5aae01e5a95094de02978388f6477a483a3d76872cf6bd1bc5c4c2c72",
        "f5da4df71704dfb4d1cb9a0395c6d8b5c434f687be2ab672fc8e147e20ddd838",
    ),
    (
        "avx512",
        3,
        "h2o",
        "318c80b5aae01e5a95094de02978388f6477a483a3d76872cf6bd1bc5c4c2c72",
        "43468b1d4775b117504b36ac6f3baf4d9c57258b2c3e47eb61e7bb15656bbfd3",
    ),
    (
        "avx512",
        3,
        "snapkv",
        "318c80b5aae01e5a95094de02978388f6477a483a3d76872cf6bd1bc5c4c2c72",
        "bdc60411f8b5dc2fef5417750f9fe8f461cfd490ff3ce7dc10a4d2ee1bdf4889",
    ),
    (
        "avx512",
        3,
        "adakv",
        "318c80b5aae01e5a95094de02978388f6477a483a3d76872cf6bd1bc5c4c2c72",
        "d8bb83f2fe18908f7c749cb952df8de6b630bf286640c85af2d2d163154f22a9",
    ),
    (
        "avx512",
        3,
        "epikv",
        "318c80b5aae01e5a95094de02978388f6477a483a3d76872cf6bd1bc5c4c2c72",
        "fda0a1f9655439c77b3da0fdc675b352b6871999a5912e8c1b3cdf1d17c7386f",
    ),
    (
        "avx512",
        3,
        "epikv-lag",
        "318c80b5aae01e5a95094de02978388f6477a483a3d76872cf6bd1bc5c4c2c72",
        "6194f7f2a0bfb166af0143d5211c35e1f90028df5295f91b88bde0b36743fa80",
    ),
    (
        "avx512",
        4,
        "full",
        "a6118d2b38f905e1a2508f4aeb7c90811f44ba86247101ec4a154af3fe402a1a",
        "2f7710555b8e0b6b8358ffe346cd708091d0663f2238aa686536fc5a54c904f8",
    ),
    (
        "avx512",
        4,
        "window",
        "a6118d2b38f905e1a2508f4aeb7c90811f44ba86247101ec4a154af3fe402a1a",
        "1e4beff1d5fe6a0beb9a9bd1a2fa90de40387c62ee330889823498d2c5234173",
    ),
    (
        "avx512",
        4,
        "h2o",
        "a6118d2b38f905e1a2508f4aeb7c90811f44ba86247101ec4a154af3fe402a1a",
        "ff8ce993ece2731517e9a095e9f7616673723a080c94d4b050d8df16af066755",
    ),
    (
        "avx512",
        4,
        "snapkv",
        "a6118d2b38f905e1a2508f4aeb7c90811f44ba86247101ec4a154af3fe402a1a",
        "68d99850d468cd88407c0a310f029496a1fb6e59732771ee82c5f9ab706ca7b2",
    ),
    (
        "avx512",
        4,
        "adakv",
        "a6118d2b38f905e1a2508f4aeb7c90811f44ba86247101ec4a154af3fe402a1a",
        "03b3a1c5503405e128f9441e6fe30035b1a1faba9c39ef41a937c3e4b5d339d2",
    ),
    (
        "avx512",
        4,
        "epikv",
        "b0f767be040b03da165dbab617c3a0d79e9bbbb68f5adcbc73261fbaf97101aa",
        "456aec130256a46b11032760832f96135ce9addc8652c3bebee45e5d23b2f2a4",
    ),
    (
        "avx512",
        4,
        "epikv-lag",
        "a82916c36340225d21497e432a83f2886935e287b9aeacbddae8678d9d01d2b2",
        "8094aa278d5827270292f66fd0b2891b6f8e7748ecc8c66996e0660bda3b7645",
    ),
    (
        "avx512-vnni",
        0,
        "full",
        "697f31d5816026fa77a20528bb5d0ab50971fd13cffd0e0ccc1fcf4ff091cf27",
        "c0bc95e3df5144f49ae1e375da1a517a13f1a4649ae28925c518dd24fe66f7fd",
    ),
    (
        "avx512-vnni",
        0,
        "window",
        "697f31d5816026fa77a20528bb5d0ab50971fd13cffd0e0ccc1fcf4ff091cf27",
        "2c69389b914cad3716dd597eef9d2f889fcf8a766f5c82aa6c40a6d78b902c68",
    ),
    (
        "avx512-vnni",
        0,
        "h2o",
        "c4ae698e22eb3b8aef2c51e0fd111894cab8c53fcaa5daf8315631d633d2fb5d",
        "f11d3011ed23fbbc020eef0a827a053bf6782acc2921688a7bcbf4dc36a5ea84",
    ),
    (
        "avx512-vnni",
        0,
        "snapkv",
        "697f31d5816026fa77a20528bb5d0ab50971fd13cffd0e0ccc1fcf4ff091cf27",
        "930f9ecd96bf7d114cdbfb3f2e0c8496a88d9819cb582b8096a14b62399c878f",
    ),
    (
        "avx512-vnni",
        0,
        "adakv",
        "697f31d5816026fa77a20528bb5d0ab50971fd13cffd0e0ccc1fcf4ff091cf27",
        "5a270ee48934669c97ad2fbb0e1eb432071f23a7ab08c735826ac13f88d5a788",
    ),
    (
        "avx512-vnni",
        0,
        "epikv",
        "ea006ed665c33e5d4e74770feff599291f59e49f59dbc730a21577e9fac48727",
        "802e09411f7f981a0f043b41c61d4f7c24756c6bc24303739ceed63f6b9c5093",
    ),
    (
        "avx512-vnni",
        0,
        "epikv-lag",
        "72cb16be001caac62ae39fb3011484860a70887993ffd985233033fcdeda3e8f",
        "ed851d548f1ec8743b514ad904a725e1ce788fcf5fb49d7d2ab8c12eb25bf00d",
    ),
    (
        "avx512-vnni",
        1,
        "full",
        "e1390660113518a402e025b003804c5d94c8eda7ba909be1bcbb4ac5b25aae0c",
        "caa2a1a6329ab3f1173521ebd64e60e127b33be69c6081ee690c4ba4d0cc673c",
    ),
    (
        "avx512-vnni",
        1,
        "window",
        "df5a7e4be30d63352b633d33e1490c9c003bd84ac7d8367d81b4057d21c163bb",
        "09b96db17dad0099bc468f1d16e7c2fdc1dd1e44ef0dd7e02c89d3848f8e02ae",
    ),
    (
        "avx512-vnni",
        1,
        "h2o",
        "4521404ac4e4566224fe3367b528bf3781c1632f7533200872e95bf30e06adde",
        "e15867883ac83e848f086dcbe72a133e43612151bfff4309174c338fe904931a",
    ),
    (
        "avx512-vnni",
        1,
        "snapkv",
        "9612037925f8ffae547e6d1dee77419cbc43ed049fa37f87a0472a808077cca5",
        "3a4d2ec6bb59dce0ce7408c2649ea334761f0e34e1ece000b283d0ea8127535a",
    ),
    (
        "avx512-vnni",
        1,
        "adakv",
        "2e1a0e6e8d0a764304854b4871686b3a87231116fc3798fab69bb97ffcac0120",
        "3358d8c2e2e8d8354043340a680910fbc9fc3fe409f501c1a8f220aa22d88fd2",
    ),
    (
        "avx512-vnni",
        1,
        "epikv",
        "ef84cdc985263b78aee558a2e1887c97ad932a18ff1e2b15ac8f34f23ebcb359",
        "804ae3c9594a074b20cac9d4b0243e7b526ead1106a457dcbac2f971315b75b9",
    ),
    (
        "avx512-vnni",
        1,
        "epikv-lag",
        "9098deb2bcdbc444707efd31d1dbbb73a65086e934ba306ae3f33375a8a6b7f3",
        "e1fa1fb0b5f2fb1a9a57333f6bd40955da2897144c5a7860eeb22170a2a3eb1f",
    ),
    (
        "avx512-vnni",
        2,
        "full",
        "bb78243c384bfdf03d86fa9cc04435f5779e76f53156308bf2f0359698bd099a",
        "47a65cfa808b453c64f8ab5545c98a0dff5bc114377d2b768ff6d26d7f4285fb",
    ),
    (
        "avx512-vnni",
        2,
        "window",
        "a7b13f173bf03344ea55b34a7c16ca965bcadfc397c1564dfb8ed57d360faf8f",
        "1d2a5fa60dd20e7699afb8a5118ae0b15430dd1d9395629aea6ce53cbd9d80ab",
    ),
    (
        "avx512-vnni",
        2,
        "h2o",
        "6e9da447c0c41f22a4305c5bfd7fa01294770bb96db7f32ce871282e9ab8a61f",
        "f181bde634d6761c3b14be59e3410aa9bf00917bd8e4dbd864c9a2dcc36fbd61",
    ),
    (
        "avx512-vnni",
        2,
        "snapkv",
        "cd310631f3677ec65b52307d8716d6a540897507f86911bb040d292754544c72",
        "49049e6ff7fcc9aefb15f61cf6bfa22d28dc4dac4f8c3fc6d2ea8936b2b6680e",
    ),
    (
        "avx512-vnni",
        2,
        "adakv",
        "617b440d239e4282187b29d4f376bfb12ed5bd17b53f00ceeb1eda554ed2049e",
        "dc6ab50c3b86decb7f6bde7f0fa2cee921de1896dbaa83e64d2b8d1fc1627a76",
    ),
    (
        "avx512-vnni",
        2,
        "epikv",
        "af806138fbd22d4b7cc8e7122fcf664ae285f9aaabe93ee1c14a9bca586c6b0c",
        "818729a8d1d1646dbf75bf1fda8ba6502d79a7e977e40755ada9cb42403b57b0",
    ),
    (
        "avx512-vnni",
        2,
        "epikv-lag",
        "52ddf992fb12e9509226b87716576e282af35d773bbc21234b659eaed91c7c96",
        "878721b89d330d4d19784f613f2355fc7fe6b6ddf63502274fe0df0106b4ff81",
    ),
    (
        "avx512-vnni",
        3,
        "full",
        "318c80b5aae01e5a95094de02978388f6477a483a3d76872cf6bd1bc5c4c2c72",
        "e8fe9c4028a390742a88e506c9db468c43cecc852cf65866fe62ae4f01510f73",
    ),
    (
        "avx512-vnni",
        3,
        "window",
        "318c80b5aae01e5a95094de02978388f6477a483a3d76872cf6bd1bc5c4c2c72",
        "f5da4df71704dfb4d1cb9a0395c6d8b5c434f687be2ab672fc8e147e20ddd838",
    ),
    (
        "avx512-vnni",
        3,
        "h2o",
        "318c80b5aae01e5a95094de02978388f6477a483a3d76872cf6bd1bc5c4c2c72",
        "43468b1d4775b117504b36ac6f3baf4d9c57258b2c3e47eb61e7bb15656bbfd3",
    ),
    (
        "avx512-vnni",
        3,
        "snapkv",
        "318c80b5aae01e5a95094de02978388f6477a483a3d76872cf6bd1bc5c4c2c72",
        "bdc60411f8b5dc2fef5417750f9fe8f461cfd490ff3ce7dc10a4d2ee1bdf4889",
    ),
    (
        "avx512-vnni",
        3,
        "adakv",
        "318c80b5aae01e5a95094de02978388f6477a483a3d76872cf6bd1bc5c4c2c72",
        "d8bb83f2fe18908f7c749cb952df8de6b630bf286640c85af2d2d163154f22a9",
    ),
    (
        "avx512-vnni",
        3,
        "epikv",
        "318c80b5aae01e5a95094de02978388f6477a483a3d76872cf6bd1bc5c4c2c72",
        "fda0a1f9655439c77b3da0fdc675b352b6871999a5912e8c1b3cdf1d17c7386f",
    ),
    (
        "avx512-vnni",
        3,
        "epikv-lag",
        "318c80b5aae01e5a95094de02978388f6477a483a3d76872cf6bd1bc5c4c2c72",
        "6194f7f2a0bfb166af0143d5211c35e1f90028df5295f91b88bde0b36743fa80",
    ),
    (
        "avx512-vnni",
        4,
        "full",
        "a6118d2b38f905e1a2508f4aeb7c90811f44ba86247101ec4a154af3fe402a1a",
        "2f7710555b8e0b6b8358ffe346cd708091d0663f2238aa686536fc5a54c904f8",
    ),
    (
        "avx512-vnni",
        4,
        "window",
        "a6118d2b38f905e1a2508f4aeb7c90811f44ba86247101ec4a154af3fe402a1a",
        "1e4beff1d5fe6a0beb9a9bd1a2fa90de40387c62ee330889823498d2c5234173",
    ),
    (
        "avx512-vnni",
        4,
        "h2o",
        "a6118d2b38f905e1a2508f4aeb7c90811f44ba86247101ec4a154af3fe402a1a",
        "ff8ce993ece2731517e9a095e9f7616673723a080c94d4b050d8df16af066755",
    ),
    (
        "avx512-vnni",
        4,
        "snapkv",
        "a6118d2b38f905e1a2508f4aeb7c90811f44ba86247101ec4a154af3fe402a1a",
        "68d99850d468cd88407c0a310f029496a1fb6e59732771ee82c5f9ab706ca7b2",
    ),
    (
        "avx512-vnni",
        4,
        "adakv",
        "a6118d2b38f905e1a2508f4aeb7c90811f44ba86247101ec4a154af3fe402a1a",
        "03b3a1c5503405e128f9441e6fe30035b1a1faba9c39ef41a937c3e4b5d339d2",
    ),
    (
        "avx512-vnni",
        4,
        "epikv",
        "b0f767be040b03da165dbab617c3a0d79e9bbbb68f5adcbc73261fbaf97101aa",
        "456aec130256a46b11032760832f96135ce9addc8652c3bebee45e5d23b2f2a4",
    ),
    (
        "avx512-vnni",
        4,
        "epikv-lag",
        "a82916c36340225d21497e432a83f2886935e287b9aeacbddae8678d9d01d2b2",
        "8094aa278d5827270292f66fd0b2891b6f8e7748ecc8c66996e0660bda3b7645",
    ),
];

/// Greedy run of `prompt` under `policy`: (token hash, logits hash).
fn run_case<'w>(
    w: &'w Weights<'w>,
    model: &std::path::Path,
    ids: &[u32],
    policy: &str,
    threads: usize,
) -> (String, String) {
    let mut args = vec!["t".to_string(), "--policy".into(), policy.into()];
    if policy != "full" {
        args.extend(["--kv-budget".into(), BUDGET.to_string()]);
    }
    let f = Flags::parse_from(args);
    let n_ctx = ids.len() + N_GEN + 1;
    let mut s =
        f.kv.session(w, 7, model, n_ctx, threads, 32, ids.len())
            .unwrap_or_else(|e| panic!("{policy}: {e}"));
    let mut lh = Sha256::new();
    let mut toks: Vec<u32> = Vec::new();
    let logits = s.feed(ids, Logits::All).unwrap().to_vec();
    for x in &logits {
        lh.update(x.to_le_bytes());
    }
    let vocab = w.config.vocab;
    let mut last = logits[logits.len() - vocab..].to_vec();
    for _ in 0..N_GEN {
        let t = argmax(&last);
        toks.push(t);
        last = s.feed(&[t], Logits::Last).unwrap().to_vec();
        for x in &last {
            lh.update(x.to_le_bytes());
        }
    }
    if policy != "full" {
        assert!(s.n_evicted > 0, "{policy}: the budget never evicted");
    }
    let mut th = Sha256::new();
    for t in &toks {
        th.update(t.to_le_bytes());
    }
    (hex(&th.finalize()), hex(&lh.finalize()))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[test]
fn greedy_tokens_and_logits_match_the_recorded_hashes() {
    let path = util::default_model();
    let g = Gguf::open(&path).unwrap();
    let w = Weights::from_gguf(&g).unwrap();
    let tok = Tokenizer::from_gguf(&g).unwrap();
    util::rerun_at_lower_levels("identity::greedy_tokens_and_logits_match_the_recorded_hashes");
    let prof = util::kernel_profile();
    let recorded: Vec<_> = RECORDED.iter().filter(|r| r.0 == prof).collect();
    let mut lines = Vec::new();
    let mut mismatches = Vec::new();
    for (pi, p) in PROMPTS.iter().enumerate() {
        let ids = tok.encode(p, true, false).unwrap();
        for pol in POLICIES {
            let (th, lh) = run_case(&w, &path, &ids, pol, 1);
            lines.push(format!(
                "    (\"{prof}\", {pi}, \"{pol}\", \"{th}\", \"{lh}\"),"
            ));
            match recorded.iter().find(|r| r.1 == pi && r.2 == pol) {
                Some(r) => {
                    if r.3 != th || r.4 != lh {
                        mismatches.push(format!(
                            "prompt {pi} {pol}: tokens {} logits {}",
                            if r.3 == th { "same" } else { "DIFFER" },
                            if r.4 == lh { "same" } else { "DIFFER" }
                        ));
                    }
                }
                None => {
                    // no record for this profile: self-consistency only
                    assert_eq!(
                        run_case(&w, &path, &ids, pol, 1),
                        (th.clone(), lh.clone()),
                        "prompt {pi} {pol}: two runs differ"
                    );
                    assert_eq!(
                        run_case(&w, &path, &ids, pol, 2),
                        (th, lh),
                        "prompt {pi} {pol}: 1 and 2 threads differ"
                    );
                }
            }
        }
    }
    eprintln!("hashes for profile {prof}:\n{}", lines.join("\n"));
    if recorded.is_empty() {
        eprintln!("no hashes recorded for kernel profile {prof}: checked self-consistency only");
    } else {
        assert_eq!(
            recorded.len(),
            PROMPTS.len() * POLICIES.len(),
            "incomplete record for {prof}"
        );
    }
    assert!(mismatches.is_empty(), "changed: {mismatches:#?}");
}
