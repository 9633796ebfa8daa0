//! Nothing users see changes when the engine's insides move: for 5 prompts ×
//! 7 policies (full, window, h2o, snapkv, adakv, epikv, epikv-lag) at a
//! budget every one of them must evict under, the SHA-256 of the greedy token
//! ids and of the f32 logits at every position (each prompt position, then
//! each decoded step) must equal the hashes recorded before the device-seam
//! redesign (on commit 00f5acf).
//!
//! Floating-point results depend on which kernels the CPU runs (the SIMD
//! attention/GEMM paths sum in another order than the portable ones), so
//! hashes are recorded per kernel profile: portable (then called avx2) on
//! 00f5acf; avx512 and avx512-vnni later, once an AVX-512 machine had
//! checked the first ones at `KVRUN_CPU=avx2`; avx2 when the AVX2 decode
//! attention kernel landed (checked against portable's recorded hashes:
//! the greedy tokens, see the test). The avx512-vnni logit hashes were
//! re-recorded on 2026-12-04 when Q8_0 (the default model's tied output
//! head) got its own VNNI arithmetic (`qgemm_q8_0_vnni`: one float step per
//! block instead of ggml's 8 lanes): every greedy token hash stayed the
//! same. The test reruns itself at every lower level the CPU
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
        "portable",
        0,
        "full",
        "a44dc035a60e95ddcc6bb0dfccd044ba796474f1a2efec62157e19eab2d6fb44",
        "e9ac5d6d48d4442e80353dc86fadc07ee88d9455af8e1d1ebfe8fe588bb5c471",
    ),
    (
        "portable",
        0,
        "window",
        "6bd99732bca85a19653c4642e8c4ac7eb16f845cb8b1e544aeaaa323abc03bac",
        "3c3665de01bcf66f25b7c5e05194b632077612581799f5c4100df752d1d47d9a",
    ),
    (
        "portable",
        0,
        "h2o",
        "c91df3599f11d9a72d1332a9d0fa24fb11dbf703ebca7566309e1f3b555ccd9d",
        "41c840edf2559194ab86ec39759802c30b8e24f829419ba60a227d1bb36e51f3",
    ),
    (
        "portable",
        0,
        "snapkv",
        "079f43a1935a155e95d4ae3cecc5455e37ae62bd985449a09d113ed5f646d5af",
        "c899d9018237c51d427cde805f41d5d5537241df0a737b56ed8346a70d7bbd42",
    ),
    (
        "portable",
        0,
        "adakv",
        "50722c851146a27ae57df8a9b5669478c096c2b12aea1a89d592ccb5b67d7c18",
        "752f226e9f9fe3ad90821c3e025b8160b7865841601a21749acd478af034c814",
    ),
    (
        "portable",
        0,
        "epikv",
        "580b1c07da313e1f191355e429a3fdb0957beca054f3f840e50b769dc42c6c3d",
        "85228ea2012f5ba5f97175e69a383b4074f913bf9eef8d54fe89b213b9ae8960",
    ),
    (
        "portable",
        0,
        "epikv-lag",
        "5851f19bcac18766ec3585f899449825847e9b7084ab1f02b8bf353d6f1124fd",
        "b617ff2934ee86d8d274f9a1910eae476858a919a6ba2f0bd1e16cd7bcb8f326",
    ),
    (
        "portable",
        1,
        "full",
        "e1390660113518a402e025b003804c5d94c8eda7ba909be1bcbb4ac5b25aae0c",
        "1513ce41c2321ec03402a73359afff4194b3d60aa45a35666cf0fc42028295ed",
    ),
    (
        "portable",
        1,
        "window",
        "df5a7e4be30d63352b633d33e1490c9c003bd84ac7d8367d81b4057d21c163bb",
        "b99562bc829ec35db638024066390e0d131b9c83846040d11404159e4c85d60e",
    ),
    (
        "portable",
        1,
        "h2o",
        "4521404ac4e4566224fe3367b528bf3781c1632f7533200872e95bf30e06adde",
        "3917210e94f23ab6562291e02243fc22b3eeb675d5f0880e5e4f0fcf0a2a2be2",
    ),
    (
        "portable",
        1,
        "snapkv",
        "eaab55581e1b0ebbfa46c8d51736ad18f76db43d4ac57715f5b86d6257ec616a",
        "ec59d1d093f791c4fba4eade83dc6bc65e4500eb498bc03789f9795e9751040e",
    ),
    (
        "portable",
        1,
        "adakv",
        "131594903ea79c10386f4c0fd11712d4e99c6dcf2169ee903406c5ad15282bac",
        "449f51c20de79f983c5578537f0bdb9c60722b25159cb2e5265c5d5b737d0c21",
    ),
    (
        "portable",
        1,
        "epikv",
        "ef84cdc985263b78aee558a2e1887c97ad932a18ff1e2b15ac8f34f23ebcb359",
        "7ed697dc7891edd892647d531ac26907b4487f0f4a7a7171e53cf98fde15371b",
    ),
    (
        "portable",
        1,
        "epikv-lag",
        "01ddc294582b1ac3b6a4a87a54d3cea25b0aa2238849d740d1f15d463498d32f",
        "ec75406962cf01ad056c2d589ecf9b3daf17fb440f291d86cfd31fd8120034b2",
    ),
    (
        "portable",
        2,
        "full",
        "8004acba269021bf8fe6fb0dd96326002cb3e0438f89b33a88d36af5febe041f",
        "3e3a1842b9a9dc5796995b706777ecef022f446de630ff110066de50064522d4",
    ),
    (
        "portable",
        2,
        "window",
        "8004acba269021bf8fe6fb0dd96326002cb3e0438f89b33a88d36af5febe041f",
        "9f0a0cfd6458808c6a42c02a6642e594b977a110e390689e1edd7337a1c42fbc",
    ),
    (
        "portable",
        2,
        "h2o",
        "8004acba269021bf8fe6fb0dd96326002cb3e0438f89b33a88d36af5febe041f",
        "059b89404f6e127b74843cc59ce2924ec68b5b12737f6a547c408e9ec29743cc",
    ),
    (
        "portable",
        2,
        "snapkv",
        "8004acba269021bf8fe6fb0dd96326002cb3e0438f89b33a88d36af5febe041f",
        "0a47f74be5ac9f30b8c1450ed82b1e923c9bf2c82011c37a6b347917d345b8da",
    ),
    (
        "portable",
        2,
        "adakv",
        "8004acba269021bf8fe6fb0dd96326002cb3e0438f89b33a88d36af5febe041f",
        "0954eac527b2e47bb0655ecfc2f597ec0635c4d814eb3b5988cdf88efb8ba3cf",
    ),
    (
        "portable",
        2,
        "epikv",
        "2348d081d133c1cc3140d728e58e625be7f728dc2c9d7d648460b40d588b3c49",
        "75ec2f9d5c81a113827a12637b32200d981f819e185af4912118c4ca50797c18",
    ),
    (
        "portable",
        2,
        "epikv-lag",
        "e39cc1b2e9968b87942c3690e5137c838fc99276428cf69b02d93c33988bfd77",
        "9e8a04f1663538b976eccd02bf39279074de09075a1d7a906be2abd6064ab647",
    ),
    (
        "portable",
        3,
        "full",
        "318c80b5aae01e5a95094de02978388f6477a483a3d76872cf6bd1bc5c4c2c72",
        "59b9f9061f6eab0e73c2863b7349b3fd3bab3e2e6d48b35dbe460417ddea3144",
    ),
    (
        "portable",
        3,
        "window",
        "318c80b5aae01e5a95094de02978388f6477a483a3d76872cf6bd1bc5c4c2c72",
        "dd16c2feca3f375b70d67cec26132cb6d570b5fff8561ba5deb09b784edbc7ff",
    ),
    (
        "portable",
        3,
        "h2o",
        "318c80b5aae01e5a95094de02978388f6477a483a3d76872cf6bd1bc5c4c2c72",
        "41bde999a7a86cbf6863043333658ce8007736b5464afaa39ca20231bb86557a",
    ),
    (
        "portable",
        3,
        "snapkv",
        "318c80b5aae01e5a95094de02978388f6477a483a3d76872cf6bd1bc5c4c2c72",
        "f6505d55fb88ebc89ef1e1dc6d5c2076af274ced6bfb563d0749e8ac613f3d5f",
    ),
    (
        "portable",
        3,
        "adakv",
        "318c80b5aae01e5a95094de02978388f6477a483a3d76872cf6bd1bc5c4c2c72",
        "d9e1dda81ac4f87633df245ad69fb04960b56a71afd25c4b0ef2816cac78e926",
    ),
    (
        "portable",
        3,
        "epikv",
        "318c80b5aae01e5a95094de02978388f6477a483a3d76872cf6bd1bc5c4c2c72",
        "e468a03f16141ea7015a6fc720f334df858161247e34a71ad32da26ebdc6b168",
    ),
    (
        "portable",
        3,
        "epikv-lag",
        "318c80b5aae01e5a95094de02978388f6477a483a3d76872cf6bd1bc5c4c2c72",
        "56b9d6031c13078c4471ed51967b19d4a56ba61ad8094312aba4be22a4882c6b",
    ),
    (
        "portable",
        4,
        "full",
        "a6118d2b38f905e1a2508f4aeb7c90811f44ba86247101ec4a154af3fe402a1a",
        "65963c712155486643ef7f0187081040c3bb79ac062fa5f98a4e0e09abda2120",
    ),
    (
        "portable",
        4,
        "window",
        "a6118d2b38f905e1a2508f4aeb7c90811f44ba86247101ec4a154af3fe402a1a",
        "a5a11c2fd26c74105b50902f555fd7707f7051528e028764d16a35d7465ec4bf",
    ),
    (
        "portable",
        4,
        "h2o",
        "a6118d2b38f905e1a2508f4aeb7c90811f44ba86247101ec4a154af3fe402a1a",
        "0968403d44174c593a226a8e8eea5018db7c1aaf57768b01011b558dd4f2c068",
    ),
    (
        "portable",
        4,
        "snapkv",
        "a6118d2b38f905e1a2508f4aeb7c90811f44ba86247101ec4a154af3fe402a1a",
        "33bd5392eb2fefc2c55859dbae8c3f90d863a542ef6a793d96c442e82bf90b5d",
    ),
    (
        "portable",
        4,
        "adakv",
        "a6118d2b38f905e1a2508f4aeb7c90811f44ba86247101ec4a154af3fe402a1a",
        "10bd2d597635bd553a221ea46a6e643c0db73322a124d946dafee6c11c0c4d92",
    ),
    (
        "portable",
        4,
        "epikv",
        "a6118d2b38f905e1a2508f4aeb7c90811f44ba86247101ec4a154af3fe402a1a",
        "de5ad0113454b5ab5fa84538418c53f582d46c1dcecfb89824c38b7f373ec8c7",
    ),
    (
        "portable",
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
        "fae23e97dda42e69789fef26d582911a3b56fea9a5287a16435b851d290b51ca",
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
        "ba8fa4364428f628ca295ea8d03aa2a21f5a25f773eb80bb4bcee2e1de731ff6",
        "203ce53880d5738fdf2a6c07316f74d7ea09bab8ae41ba323801386a25a334d9",
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
        "cb89d96181a888e9ca942aaa785c3914929ebb56e65dbbec9c4400102d7ea0b8",
        "89183ae42dc71b77bdf6dc63f9fa8a0a2bd77be8d8834d11414ae9debeb49ecd",
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
        "788266fb8e396aa9f2e78f82a9a144e83de6b7f3ef781279aa137844661225b1",
        "e35f0349a5cfccdfb2d004d99725781aae8ef98bc807fe021722ae100dc9cb66",
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
        "32c1deb351a56c4bbe09fbbc4644b637a73351493d9d13f40956b449a1972882",
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
        "bbb2a751cdf1ac54bfe1dc67a0dee30f7c4716fb88f30c20896a276bf2a36a38",
    ),
    (
        "avx512-vnni",
        0,
        "window",
        "697f31d5816026fa77a20528bb5d0ab50971fd13cffd0e0ccc1fcf4ff091cf27",
        "d51793eae072fa1114dcba6df58871c61588ee944dce0d5e38996f679eb0331a",
    ),
    (
        "avx512-vnni",
        0,
        "h2o",
        "c4ae698e22eb3b8aef2c51e0fd111894cab8c53fcaa5daf8315631d633d2fb5d",
        "ded6b5f1a4bf89fb1888a2708b4ebeb51f21fc77ed18b943a5a9ccda47130767",
    ),
    (
        "avx512-vnni",
        0,
        "snapkv",
        "697f31d5816026fa77a20528bb5d0ab50971fd13cffd0e0ccc1fcf4ff091cf27",
        "6084a2479ec884102f4cf07021e03c55c5768369c3299e7d690e87550e9bf3da",
    ),
    (
        "avx512-vnni",
        0,
        "adakv",
        "697f31d5816026fa77a20528bb5d0ab50971fd13cffd0e0ccc1fcf4ff091cf27",
        "c0fb7c926967e23b04db40f5de65ac30a636734d76c2bdfca05a43b2783dd995",
    ),
    (
        "avx512-vnni",
        0,
        "epikv",
        "ea006ed665c33e5d4e74770feff599291f59e49f59dbc730a21577e9fac48727",
        "14338e0196a58bd1c9e55cce37bd23801ed7de702ed88dc6e73ff5f0d7a9ea8d",
    ),
    (
        "avx512-vnni",
        0,
        "epikv-lag",
        "72cb16be001caac62ae39fb3011484860a70887993ffd985233033fcdeda3e8f",
        "dea618f2322db4b387a4aa09f9527c78bed5c0451e18e6a0b9209a6b3bbce902",
    ),
    (
        "avx512-vnni",
        1,
        "full",
        "e1390660113518a402e025b003804c5d94c8eda7ba909be1bcbb4ac5b25aae0c",
        "00bda1dac3f568d366b01768a997a2e6fe24824475b6a79c775aacb7e3d4e74d",
    ),
    (
        "avx512-vnni",
        1,
        "window",
        "df5a7e4be30d63352b633d33e1490c9c003bd84ac7d8367d81b4057d21c163bb",
        "6307bce4d721ca728de113846d99d1db0b30d588a506fa7dfad857209ddc206f",
    ),
    (
        "avx512-vnni",
        1,
        "h2o",
        "4521404ac4e4566224fe3367b528bf3781c1632f7533200872e95bf30e06adde",
        "e69682f057a5a41f63c424d57d85907e0a7b3518e77e8bf840d80025691d8ffe",
    ),
    (
        "avx512-vnni",
        1,
        "snapkv",
        "9612037925f8ffae547e6d1dee77419cbc43ed049fa37f87a0472a808077cca5",
        "d9b2a8cc1e121dd69ee82c6b1c0c9117abefbb3f6c58ec80c1423b176f2e1ccd",
    ),
    (
        "avx512-vnni",
        1,
        "adakv",
        "ba8fa4364428f628ca295ea8d03aa2a21f5a25f773eb80bb4bcee2e1de731ff6",
        "cde4295eab10d43a93a044cf25ae56263e1f780f6bf01209711ae7cfa185f93b",
    ),
    (
        "avx512-vnni",
        1,
        "epikv",
        "ef84cdc985263b78aee558a2e1887c97ad932a18ff1e2b15ac8f34f23ebcb359",
        "cded4d92fd7e5fea975d4e3a4cd4d0406cc99491d797380b8b8770b3b5049571",
    ),
    (
        "avx512-vnni",
        1,
        "epikv-lag",
        "9098deb2bcdbc444707efd31d1dbbb73a65086e934ba306ae3f33375a8a6b7f3",
        "04d356bb5e4c2bb3948f997d5617466df265ca7d01c68d42c6071582f6381081",
    ),
    (
        "avx512-vnni",
        2,
        "full",
        "bb78243c384bfdf03d86fa9cc04435f5779e76f53156308bf2f0359698bd099a",
        "ae2cd467dc161364b4afb6fd77ab5787429591df18370291eedaea896483d23e",
    ),
    (
        "avx512-vnni",
        2,
        "window",
        "a7b13f173bf03344ea55b34a7c16ca965bcadfc397c1564dfb8ed57d360faf8f",
        "0b6b2e20028c71e0f2d793f885d6fc18c95f22968d441906a34d03d79ea0cb7c",
    ),
    (
        "avx512-vnni",
        2,
        "h2o",
        "6e9da447c0c41f22a4305c5bfd7fa01294770bb96db7f32ce871282e9ab8a61f",
        "b5aff9d7573ddb8c6a469b830c03a5a87f20b5139fcdb50c2ac5c4f57d70449a",
    ),
    (
        "avx512-vnni",
        2,
        "snapkv",
        "cd310631f3677ec65b52307d8716d6a540897507f86911bb040d292754544c72",
        "a02f2c45d574b3e883723ab198ce920ba500e31b1eac368b3222e6757db6a2b4",
    ),
    (
        "avx512-vnni",
        2,
        "adakv",
        "cb89d96181a888e9ca942aaa785c3914929ebb56e65dbbec9c4400102d7ea0b8",
        "842e131482021c122233d659ac6b05bc6c3d6e83432867cace56898123db2b34",
    ),
    (
        "avx512-vnni",
        2,
        "epikv",
        "af806138fbd22d4b7cc8e7122fcf664ae285f9aaabe93ee1c14a9bca586c6b0c",
        "ada0800ab0b1db99201086f5621bee8a06b0ac90daf7ee8029088d70344bb049",
    ),
    (
        "avx512-vnni",
        2,
        "epikv-lag",
        "52ddf992fb12e9509226b87716576e282af35d773bbc21234b659eaed91c7c96",
        "acacc11c52d966880432766704a7dd73d775708ad32444356653e5650b7e11b2",
    ),
    (
        "avx512-vnni",
        3,
        "full",
        "318c80b5aae01e5a95094de02978388f6477a483a3d76872cf6bd1bc5c4c2c72",
        "1b14b0aac44ba0cc889dc155190000897c532840c3dffe5835ad3c9a50418ee0",
    ),
    (
        "avx512-vnni",
        3,
        "window",
        "318c80b5aae01e5a95094de02978388f6477a483a3d76872cf6bd1bc5c4c2c72",
        "8c044d2fb6a37d3b002f8313cca619b67aefa579da7e00be4f651ed9ececfe62",
    ),
    (
        "avx512-vnni",
        3,
        "h2o",
        "318c80b5aae01e5a95094de02978388f6477a483a3d76872cf6bd1bc5c4c2c72",
        "e4a767aa239ff679317f5fe48b194705a03d286e2c44617bda67480e921dd4e0",
    ),
    (
        "avx512-vnni",
        3,
        "snapkv",
        "318c80b5aae01e5a95094de02978388f6477a483a3d76872cf6bd1bc5c4c2c72",
        "0e3d24b70819ba429117700ea86ecbb7cdf48a34d82a8eaf77f712343c1410c4",
    ),
    (
        "avx512-vnni",
        3,
        "adakv",
        "788266fb8e396aa9f2e78f82a9a144e83de6b7f3ef781279aa137844661225b1",
        "2dc15d57a901a601e600661f87a732c3ba1fce6aa11c5376242c3757c02204f9",
    ),
    (
        "avx512-vnni",
        3,
        "epikv",
        "318c80b5aae01e5a95094de02978388f6477a483a3d76872cf6bd1bc5c4c2c72",
        "15143e0973ca21da086e34c8619279ba822107ae5df8711bf6efcba98703b116",
    ),
    (
        "avx512-vnni",
        3,
        "epikv-lag",
        "318c80b5aae01e5a95094de02978388f6477a483a3d76872cf6bd1bc5c4c2c72",
        "ec949f08f6417f2f8c34c1c6113ce173f7a703794df8ca1b379afec193fc155e",
    ),
    (
        "avx512-vnni",
        4,
        "full",
        "a6118d2b38f905e1a2508f4aeb7c90811f44ba86247101ec4a154af3fe402a1a",
        "6353247ccb9f478495841d8145dc8cafad2b085d3f82f3a82cf510e833237d7d",
    ),
    (
        "avx512-vnni",
        4,
        "window",
        "a6118d2b38f905e1a2508f4aeb7c90811f44ba86247101ec4a154af3fe402a1a",
        "96cad3d69c02e21546c07ae51606be63786bf387609c10bc04b9c373fd65143f",
    ),
    (
        "avx512-vnni",
        4,
        "h2o",
        "a6118d2b38f905e1a2508f4aeb7c90811f44ba86247101ec4a154af3fe402a1a",
        "d053993d73c2b3ca4781f2ccd37379807f263b7dd03a70ac2528cac85ebb060c",
    ),
    (
        "avx512-vnni",
        4,
        "snapkv",
        "a6118d2b38f905e1a2508f4aeb7c90811f44ba86247101ec4a154af3fe402a1a",
        "bf35eaf886e768ad59d79ff79ec06e7bb8e1ac32298ed2355c4c3bca864a71be",
    ),
    (
        "avx512-vnni",
        4,
        "adakv",
        "a6118d2b38f905e1a2508f4aeb7c90811f44ba86247101ec4a154af3fe402a1a",
        "0c44d57b6d64938b3a385821498d5a5d3673c58cf36f002b1a44db78b989af32",
    ),
    (
        "avx512-vnni",
        4,
        "epikv",
        "b0f767be040b03da165dbab617c3a0d79e9bbbb68f5adcbc73261fbaf97101aa",
        "6f744ad7b27cd572df82b1342b10e513b3829ebe01ac5ee3b71dcdb071795bc4",
    ),
    (
        "avx512-vnni",
        4,
        "epikv-lag",
        "a82916c36340225d21497e432a83f2886935e287b9aeacbddae8678d9d01d2b2",
        "647239a4987e1bcf3ff738251892f5fe750b45dfbaa8b4e85030abe227d23ffb",
    ),
    (
        "avx2",
        0,
        "full",
        "697f31d5816026fa77a20528bb5d0ab50971fd13cffd0e0ccc1fcf4ff091cf27",
        "5ba9893af6689fd2e0f2c3db37cae894fadbdc65805c9c810e5a8a58bc8e252e",
    ),
    (
        "avx2",
        0,
        "window",
        "697f31d5816026fa77a20528bb5d0ab50971fd13cffd0e0ccc1fcf4ff091cf27",
        "6f36478dbbf7f775b9a2d32d0ce2759adb21f17b1348917beafb354ceb10b5c2",
    ),
    (
        "avx2",
        0,
        "h2o",
        "cb91e5f653fbe6dcf323a03369f5b57a08bf89f70e774340301a55b6567a9408",
        "f9b79c05b7a1bb687a681b241aa7ad133b642389806067690c064a0d0041dc7e",
    ),
    (
        "avx2",
        0,
        "snapkv",
        "398802cbf0eb6ae70d44ad99dc542bd14b80bfccb74947f38fe5d2fe6388fb08",
        "cef57e95b2af151f90b53b46c55046884c5e01b43889d702032c5744c7023f45",
    ),
    (
        "avx2",
        0,
        "adakv",
        "697f31d5816026fa77a20528bb5d0ab50971fd13cffd0e0ccc1fcf4ff091cf27",
        "359120252dca9009b3525344876f0f685a7de0e56c484d29a34c5aa89df07e56",
    ),
    (
        "avx2",
        0,
        "epikv",
        "4e9c6620dd5f118eed766ce687742a66e9824622accb6be3404168a71ed69a98",
        "9c9507c73b431884ab0a17c4582a3394cc1a0c4c647a00104346806b03b8dc3e",
    ),
    (
        "avx2",
        0,
        "epikv-lag",
        "5ed99b880e5eefbea36cab5d4df0d67ca393db4dcf2f448823e175a3375f65c3",
        "1fcd60741e349ceaec9f211fb4d01caeeccd74b507ecc45493600c78479fbe67",
    ),
    (
        "avx2",
        1,
        "full",
        "1ded7c76ae0f116edb1cc4fe4d0ba1dd6e3e156025fbcb5f9a1a9bfc3a9ede52",
        "c655fe98cfecd86acded1ed507a0dc8c0373f1c2da01dba3f68fd32001af821d",
    ),
    (
        "avx2",
        1,
        "window",
        "df5a7e4be30d63352b633d33e1490c9c003bd84ac7d8367d81b4057d21c163bb",
        "ab6327bcab50cae5836e1047761afedda16e1acc8ba09fae17ad59fba9f08cdd",
    ),
    (
        "avx2",
        1,
        "h2o",
        "4521404ac4e4566224fe3367b528bf3781c1632f7533200872e95bf30e06adde",
        "eb2cf99d7ee8c444f3785ff3ac4faf29dd918971d41973e553cc893464526edf",
    ),
    (
        "avx2",
        1,
        "snapkv",
        "efec61a00e058df9df6dfb894a1c06cb636717131f21ed53abf2ce39a824e2d9",
        "75b150906cab6d57762dc0e8781228867e12d84e7a98464cfae0116b6a9abeaf",
    ),
    (
        "avx2",
        1,
        "adakv",
        "ffa89a2511f7e3b9602fe4b9f826742a510a7dd8bc32d8f82f68b78af915e159",
        "6729f203e8a741ddf89b45dabd0bf4bdf3a400d3130fe28a9cde7749c176192c",
    ),
    (
        "avx2",
        1,
        "epikv",
        "ef84cdc985263b78aee558a2e1887c97ad932a18ff1e2b15ac8f34f23ebcb359",
        "dfdd46fa6ecf4c304c18be03d60626255647cd46d5f9f31d80aa1cf7e438d066",
    ),
    (
        "avx2",
        1,
        "epikv-lag",
        "9098deb2bcdbc444707efd31d1dbbb73a65086e934ba306ae3f33375a8a6b7f3",
        "6bee5a2c359b9fdeb2dad0addc01e69d45f10cba96f7c981f1dfc27e1bf845e4",
    ),
    (
        "avx2",
        2,
        "full",
        "d62081c4e208361b39dac6bd5828481b8a1f3315afd3eaacbd8418eb2d05cdcb",
        "027b25c84487754175fdacaf3c5d0bd32ebb6e1d416ae24f9bd2c08f55c1ce98",
    ),
    (
        "avx2",
        2,
        "window",
        "02a1164f379ff668479562bce0a48eff80e6d7626db0c26d9064407a85051760",
        "25fe0f2ee9096e44e12342239793cd5323c00c1472eb5bb95a4c0c2d99b8db20",
    ),
    (
        "avx2",
        2,
        "h2o",
        "da40aac8cef9945f08ad438bc0a2e1ad4fd11f6f8ac506f2d0ac829fbd42432a",
        "1bf86473a3f0eb13a01c3f41033fd23c676063a4d7998471b7099f1cbeea16d9",
    ),
    (
        "avx2",
        2,
        "snapkv",
        "a89e28cef99175343ec39c0e78a64dc1d3146d23f4f864457d5e5c416590aefe",
        "4760478494570893a7b46ed1cc3941ddcf18bc1156f269aedba4e42f27bbea78",
    ),
    (
        "avx2",
        2,
        "adakv",
        "d62081c4e208361b39dac6bd5828481b8a1f3315afd3eaacbd8418eb2d05cdcb",
        "adc6dc691e352a23405afa31dab30485f1a11c10628f53f00adaac700b00c35c",
    ),
    (
        "avx2",
        2,
        "epikv",
        "3c9286216090bb61b427f5c80b3354e80981ae59259e3cf1d758fc86491ebda1",
        "3b3a5777d0ec557b2b122777223cec183bede5acb50d6a44978585d5c34784f4",
    ),
    (
        "avx2",
        2,
        "epikv-lag",
        "6a64476bead1e5af95f90829276de3e1bd466fc441d4eb91b69fb468307fb7b6",
        "1608d6e0f8bef6fca21b96988b598a54b3c132d20698c1d5f6d8d49c2431a6e7",
    ),
    (
        "avx2",
        3,
        "full",
        "318c80b5aae01e5a95094de02978388f6477a483a3d76872cf6bd1bc5c4c2c72",
        "a9650d8b2871b25b741faa0e6a72a925b46186f138308721cfc27a6c2dc074fe",
    ),
    (
        "avx2",
        3,
        "window",
        "788266fb8e396aa9f2e78f82a9a144e83de6b7f3ef781279aa137844661225b1",
        "32f9c5c4abe21bfbc516d2b7b42ebf9336390c5aaedb00ff5f9bcfb63091abd0",
    ),
    (
        "avx2",
        3,
        "h2o",
        "788266fb8e396aa9f2e78f82a9a144e83de6b7f3ef781279aa137844661225b1",
        "d08c722cdd6aaaaa01841df64400ac2c4e4767446f69d04f81d708494ef1e0a8",
    ),
    (
        "avx2",
        3,
        "snapkv",
        "318c80b5aae01e5a95094de02978388f6477a483a3d76872cf6bd1bc5c4c2c72",
        "6497efcadb8b0ad638ad407b57afccd52c00b404283bb1094efe1d9b26a9319d",
    ),
    (
        "avx2",
        3,
        "adakv",
        "27c8c2406e6eff77c9f1b382ca444786806991fc36829402637681a9e9b66448",
        "95fc653e310facee6822bf62b31d2339644f50d21c74cbd8bdd6a5c61fa5471f",
    ),
    (
        "avx2",
        3,
        "epikv",
        "788266fb8e396aa9f2e78f82a9a144e83de6b7f3ef781279aa137844661225b1",
        "807572cf73bda712ae3889687bb0315eabfb5b5748285e07b0976205d7661751",
    ),
    (
        "avx2",
        3,
        "epikv-lag",
        "318c80b5aae01e5a95094de02978388f6477a483a3d76872cf6bd1bc5c4c2c72",
        "78730791fce0f627a5f347f36795b49416ca84809286da468022a13e3929cbc2",
    ),
    (
        "avx2",
        4,
        "full",
        "1b50d118dc39126cda266f05d2d468ba5fb316b9161e8996bb383db18babc8f2",
        "fddd6dfa0238bf4b2debbd685b83f146473bef13776a6bc97c49fcd67970f8aa",
    ),
    (
        "avx2",
        4,
        "window",
        "a6118d2b38f905e1a2508f4aeb7c90811f44ba86247101ec4a154af3fe402a1a",
        "0a50d43c0621f297bd80ca43f76a9e2ce2341c8a78ccfd3ed04855bca77e52bd",
    ),
    (
        "avx2",
        4,
        "h2o",
        "b1034158367c2939d75ed85271d98eeeeea6965850f25de7c42bd3c213ed4271",
        "37562f366f7abf60d6c8e18e0bc565c2574d9e0b45e7b3019b1862715acdca02",
    ),
    (
        "avx2",
        4,
        "snapkv",
        "a6118d2b38f905e1a2508f4aeb7c90811f44ba86247101ec4a154af3fe402a1a",
        "1df8056a24b0fcf1b1067749ed5748a2b82b81f0112a146154e3cd02b9d44269",
    ),
    (
        "avx2",
        4,
        "adakv",
        "a6118d2b38f905e1a2508f4aeb7c90811f44ba86247101ec4a154af3fe402a1a",
        "ba296e5c1a6d741243da6b794110881b803801a1547eb6904d936eed988f444f",
    ),
    (
        "avx2",
        4,
        "epikv",
        "b0f767be040b03da165dbab617c3a0d79e9bbbb68f5adcbc73261fbaf97101aa",
        "32e1df832d6b39d56c8aa360f98688cc4acbd3cf7f24600cd826a64ffe7c1d35",
    ),
    (
        "avx2",
        4,
        "epikv-lag",
        "ba6e50717d320c300079c709f61808ae816e3f9cbeae7d41293104a407bf3329",
        "545a31191dff8da46eb55e1270532c8bf08ab94be246bdede66caf43333d001e",
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
